"""The KV transfer format names (--kv-transfer), kept apart from libs.transfer (whose package
imports torch and NIXL) so the CLI offers them as choices without importing either."""

NATIVE = "native"
NVFP4 = "nvfp4"
FORMATS = (NATIVE, NVFP4)
