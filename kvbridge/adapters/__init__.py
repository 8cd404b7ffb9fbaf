"""Engine adapters: the glue between an engine's own cache objects and kvbridge's migration pools.

- ``kvbridge.adapters.trtllm``: TensorRT-LLM's ``KVCachePageTable`` (dict form) and a request's
  slot ids as ``EnginePools`` and block tables.
"""
