"""Independent reference implementations used to check the plugin's numerics.

Nothing in this package imports ``vllm_deepinfer``: the references are written from
``shared/docs/model-spec.md`` (sections 3-5) and, for V4-Flash, delegate to the
independent Hugging Face ``transformers`` implementation.

* :mod:`tests.reference.dense_v41` -- ``DenseV41``: dense, full-sequence torch
  reference of DeepSeek-V4.1-Flash (no paging, no caches, no incremental decode).
* :mod:`tests.reference.hf_v4` -- ``HFV4``: adapter that loads a V4-Flash checkpoint
  into ``transformers.DeepseekV4ForCausalLM`` on CPU.
"""
