"""Plugin packaging and registration (issue 2).

* Entry points are installed; registration is idempotent; vLLM resolves our architectures to the
  plugin's module in a fresh interpreter; `VLLM_PLUGINS` filtering and `DEEPINFER_DISABLE=1` leave
  vLLM's in-tree classes in place.
* The plugin does not break other models: a Llama runs in the same vLLM with the plugin active.
* The README demo runs end to end with vLLM's spawned engine-core process (the plugin is loaded
  again in every process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from tests.conftest import engine, model_runner, tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
RESOLVE = (
    "from vllm.plugins import load_general_plugins; load_general_plugins(); "
    "from vllm import ModelRegistry; "
    "print({a: ModelRegistry.models[a].module_name for a in ('DeepseekV41ForCausalLM', 'DeepseekV4ForCausalLM')})"
)


def _resolve(**env) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", RESOLVE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env}, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own subprocess's dict literal


def test_entry_points_installed():
    general = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    platform = {e.name: e.value for e in entry_points(group="vllm.platform_plugins")}
    assert general.get("deepinfer") == "vllm_deepinfer.plugin:register"
    assert platform.get("deepinfer_ascend") == "kernels_ascend.platform:detect"


def test_ascend_platform_plugin_inactive_off_ascend():
    from kernels_ascend.platform import detect

    assert detect() is None


def test_registration_resolves_to_plugin_and_is_idempotent():
    from vllm_deepinfer.plugin import register

    register()
    register()
    modules = _resolve()
    assert all(m == "vllm_deepinfer.models.deepseek" for m in modules.values()), modules


def test_vllm_plugins_filter_and_disable_switch():
    assert set(_resolve(VLLM_PLUGINS="deepinfer,deepinfer_ascend").values()) == {"vllm_deepinfer.models.deepseek"}
    for env in ({"VLLM_PLUGINS": "some_other_plugin"}, {"DEEPINFER_DISABLE": "1"}):
        modules = _resolve(**env)
        assert not any(m.startswith("vllm_deepinfer") for m in modules.values()), (env, modules)


def test_other_models_still_run(ckpt_root, tmp_path):
    """A Llama (random weights, our tokenizer) in the same vLLM with the plugin loaded."""
    from transformers import LlamaConfig
    from vllm import SamplingParams

    src = tiny_checkpoint(ckpt_root, "v4.1-flash", 0)
    llama = tmp_path / "llama"
    llama.mkdir()
    LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(llama)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, llama / name)
    with engine(llama, load_format="dummy", max_model_len=512, max_num_batched_tokens=512) as llm:
        out = llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        model = model_runner(llm).model
    assert len(out[0].outputs[0].token_ids) == 4
    assert type(model).__module__.startswith("vllm.model_executor.models.llama")


def test_plugin_model_is_the_one_vllm_runs(ckpt_root):
    with engine(tiny_checkpoint(ckpt_root, "v4-flash", 0), max_model_len=256, max_num_batched_tokens=256) as llm:
        model = model_runner(llm).model
    assert type(model).__module__ == "vllm_deepinfer.models.deepseek"
    assert type(model).__name__ == "DeepseekV4ForCausalLM"


def test_readme_demo_with_spawned_engine(tmp_path):
    """examples/offline_inference.py on the embedded model, engine core in its own spawned process."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "DEEPINFER_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "examples/offline_inference.py", "--max-tokens", "8"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("output: ") for line in lines) == 2, out.stdout[-3000:]
    assert any(line.startswith("chat output: ") for line in lines), out.stdout[-3000:]
    marker = json.loads((tmp_path / "demo-tiny-v4.1-flash" / ".deepinfer_checkpoint.json").read_text())
    assert marker["arch"] == "v4.1-flash"


def test_decode_only_cuda_graphs_for_plugin_architectures():
    """Our architectures get FULL_DECODE_ONLY (never breakable/piecewise capture of prefill); NONE stays NONE."""
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from vllm_deepinfer import plugin

    plugin.register()
    for arch in ("DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"):
        hook = MODELS_CONFIG_MAP[arch]
        for asked, want in ((None, CUDAGraphMode.FULL_DECODE_ONLY),
                            (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
                            (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY),
                            (CUDAGraphMode.NONE, CUDAGraphMode.NONE)):
            cfg = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=asked))
            hook.verify_and_update_config(cfg)
            assert cfg.compilation_config.cudagraph_mode == want, (arch, asked)
    assert MODELS_CONFIG_MAP["DeepseekV32ForCausalLM"].__name__ == "DeepseekV32ForCausalLM"
