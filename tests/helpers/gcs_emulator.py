"""`python tests/helpers/gcs_emulator.py PORT BUCKET`: gcp-storage-emulator serving the GCS JSON API on 127.0.0.1:PORT,
in memory, with BUCKET created.

One fix to the emulator, on the server side: real GCS sends an object's generation with its content
(the `x-goog-generation` / `x-goog-metageneration` response headers of a media download); the emulator
does not, and tensorstore's GCS driver, which Orbax writes arrays through, refuses such a read
("Malformed StorageGeneration") when it re-reads an OCDBT manifest. The clients (gcsfs, tensorstore) are
not patched: they talk HTTP to this server as they would to Google's.
"""
import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    _download(request, response, storage, *args, **kwargs)
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # noqa: BLE001 - no such object: the handler above answered 404
        return
    response["x-goog-generation"] = str(obj["generation"])
    response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))


objects.download = download     # before the server module builds its routes from the handlers

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main

    main(["start", "--host", "127.0.0.1", "--port", sys.argv[1], "--in-memory", "--default-bucket", sys.argv[2]])
