"""Engine adapters: the vLLM plugin (`engines.vllm_plugin`) and the HF transformers adapter (`engines.hf_adapter`)."""
