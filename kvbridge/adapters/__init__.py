"""Engine adapters: kvbridge joining an inference engine's own cache objects and PD machinery.

- ``kvbridge.adapters.trtllm``: TensorRT-LLM's ``KVCachePageTable`` (dict form) and a request's
  slot ids as ``EnginePools`` and block tables.
- ``kvbridge.adapters.sglang``: a prefill peer an unmodified SGLang decode accepts (bootstrap
  route, ZMQ registration, NIXL writes into the decode's buffers).
- ``kvbridge.adapters.sglang_decode``: the mirror, a decode peer an unmodified SGLang prefill sends
  requests to (bootstrap query, registration and page ids, NIXL writes into kvbridge's pools).
- ``kvbridge.adapters.vllm``: a KV connector vLLM loads by module path (consumer and producer).
- ``kvbridge.adapters.pd_proxy``: an HTTP proxy driving an SGLang and a vLLM server as one request's prefill
  and decode (``kvbridge pd-proxy``; the ``proxy`` extra).
"""
