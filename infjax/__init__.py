"""infjax: instruction-following dense retrievers in JAX/Flax (README.md)."""
import logging as _logging


class _WithoutTorchNotice(_logging.Filter):
    """Drops the notice transformers logs at import on installs without PyTorch ("PyTorch was not found").

    transformers says at import, on every install without PyTorch (`gpu` and `tpu` ones), that its models will not be
    available; infjax reads only its tokenizers and configs, so every command would print a line that concerns none of
    its users. Installed here: importing infjax comes before importing transformers."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


_logging.getLogger("transformers").addFilter(_WithoutTorchNotice())
