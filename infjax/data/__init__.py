"""The input pipeline, one stage a module (docs/data.md), put together in `pipeline`.

`inf_ir` reads the records (memory-mapped Arrow, cleaned as read), `token_store` tokenizes them once (cached on
disk), `batches` assembles a step from their ids, `packing` packs its texts into fixed-shape rows, `prefetch`
builds steps ahead of the loop. Besides: `synthetic` (the offline corpus), `tokenize` (text formats, the
tokenizer), `types`."""
