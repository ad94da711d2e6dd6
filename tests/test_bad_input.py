"""Bad input fails clearly and loses nothing (issue 2).

A broken checkpoint or config fails at load time with an error that names the tensor or field,
and a following engine in the same process starts and serves normally (nothing half-initialised).
Out-of-vocabulary token ids are rejected per request while the engine keeps serving.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import engine, tiny_checkpoint

VICTIM = "layers.2.attn.wq_b.weight"


def _edit_tensors(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint `src` to `dst`, applying `edit(tensors)` to the shard holding VICTIM."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"][VICTIM]
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != shard.name}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _nan_scale(t: dict) -> None:
    scale = t[VICTIM.replace("weight", "scale")]
    raw = scale.view(torch.uint8).clone()
    raw.view(-1)[0] = 0xFF
    t[VICTIM.replace("weight", "scale")] = raw.view(torch.float8_e8m0fnu)


CASES = {
    "missing": (lambda t: t.pop(VICTIM), f"missing tensor '{VICTIM}'"),
    "shape": (lambda t: t.__setitem__(VICTIM, t[VICTIM][:-32].clone()), f"tensor '{VICTIM}' has shape"),
    "dtype": (lambda t: t.__setitem__(VICTIM, t[VICTIM].to(torch.bfloat16)), f"tensor '{VICTIM}' has dtype BF16"),
    "nan_scale": (_nan_scale, "layers.2.attn.wq_b.scale"),
}


def _expect_load_error(model_dir: Path, needle: str) -> None:
    with pytest.raises(Exception) as info:
        with engine(model_dir):
            pass
    text = "".join(str(e) for e in _chain(info.value))
    assert needle in text, text[-2000:]


def _chain(err: BaseException):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_checkpoint_fails_at_load_naming_the_tensor(ckpt_root, tmp_path, case):
    edit, needle = CASES[case]
    src = tiny_checkpoint(ckpt_root, "v4-flash", 0)
    _expect_load_error(_edit_tensors(src, tmp_path / case, edit), needle)


def test_unknown_compress_ratio_names_the_field(ckpt_root, tmp_path):
    dst = tmp_path / "ratio"
    shutil.copytree(tiny_checkpoint(ckpt_root, "v4.1-flash", 0), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["compress_ratios"][3] = 3
    (dst / "config.json").write_text(json.dumps(cfg))
    _expect_load_error(dst, "compress_ratios[3]")


def test_engine_after_failures_and_out_of_vocabulary_ids(ckpt_root):
    """After the failed loads above, a good engine starts; OOV ids fail per request only."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=4)
    with engine(tiny_checkpoint(ckpt_root, "v4.1-flash", 0)) as llm:
        good = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)
        for bad in ([5, 10**6, 7], [5, -3]):
            with pytest.raises(VLLMValidationError, match="out of vocabulary"):
                llm.generate([TokensPrompt(prompt_token_ids=bad)], params, use_tqdm=False)
        again = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == good[0].outputs[0].token_ids
