"""The OpenAI API front: HTTP in, the same ``Frontend`` as gRPC behind.

- ``fields``: what a request may carry (the field tables ``parse`` checks and ``openapi``
  publishes) and OpenAI's error shape (``HttpError``, ``http_error``);
- ``parse``: a JSON body -> a ``GenerateRequest`` (pure);
- ``tools``: ``tools`` / ``tool_choice`` -> a constraint and a system note (pure);
- ``answer``: engine outputs -> OpenAI's JSON and server-sent events (pure);
- ``openapi``: the OpenAPI document, written from ``fields``;
- ``app``: the Starlette routes that serve them.

A new request field is a row in ``fields`` and one ``_set_*`` in ``parse``. Imports run
``app`` -> {``answer``, ``parse``, ``openapi``} -> {``tools``, ``fields``} -> the core.
"""
