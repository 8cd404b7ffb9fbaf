"""The vLLM connector's option values, without torch (the choices of ``kvbridge vllm-config``)."""

#: vLLM's ``kv_role`` for each kvbridge role name.
ROLES = {"consumer": "kv_consumer", "producer": "kv_producer", "both": "kv_both"}
CONVERT_SIDES = ("sender", "receiver")
#: The connector's transports (``kv_connector_extra_config`` ``transport``): kvbridge's own two, and
#: ``sglang`` (SGLang's PD protocol: a producer serving an unmodified SGLang decode, or a consumer fed by an
#: unmodified SGLang prefill).
TRANSPORTS = ("gloo", "nixl", "sglang")
#: The memory kinds an SGLang decode registers its compressor-state buffers as (``state_memory``).
STATE_MEMORIES = ("VRAM", "DRAM")
#: vLLM's ``kv_load_failure_policy``: what it does with a request whose load failed.
LOAD_FAILURE_POLICIES = ("fail", "recompute")
