"""`qbatch serve`: the OpenAI Batch, Files, Chat Completions and Completions API in front of
the queue (the `serve` extra: `pip install 'qbatch[serve]'`).

Modules: `app` (FastAPI app factory, thin routes), `auth` (keys -> tenants), `storage`
(local directory), `upload` (streamed multipart), `batches` (OpenAI Batch <-> bulk job),
`runner` (the lifecycle thread), `sync` (one request through the queue), `errors`
(OpenAI's error shape). Only `qbatch serve` imports this package, so the bare client
install never needs FastAPI.
"""
