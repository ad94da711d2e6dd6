"""DEEPINFER_* settings: honoured, mapped or rejected with the reason (vllm_deepinfer/serving/settings.py)."""

from __future__ import annotations

import json

import pytest

from vllm_deepinfer.serving import settings


def test_speculation_settings_map_to_speculative_config(tmp_path):
    mtp = lambda n: {"method": "mtp", "num_speculative_tokens": n}  # noqa: E731
    assert settings.speculative_config_from_env({"DEEPINFER_USE_NEXTN_DECODE": "3"}) == mtp(3)
    assert settings.speculative_config_from_env({"DEEPINFER_ENABLE_MTP_VARLEN": "1"}) == mtp(5)
    assert settings.speculative_config_from_env({"DEEPINFER_ENABLE_MTP_VARLEN": "1",
                                                 "DEEPINFER_USE_NEXTN_DECODE": "2"}) == mtp(2)
    for off in ("0", "false", "off", "none"):
        assert settings.speculative_config_from_env({"DEEPINFER_USE_NEXTN_DECODE": off}) is None
        assert settings.speculative_config_from_env({"DEEPINFER_ENABLE_MTP_VARLEN": off}) is None
        settings.check({"DEEPINFER_USE_NEXTN_DECODE": off, "DEEPINFER_ENABLE_MTP_VARLEN": off}, platform_device="cpu")
    for model_type, method in (("deepseek_v41", "dspark"), ("deepseek_v4", "mtp")):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert settings.speculative_config_from_env({"DEEPINFER_USE_NEXTN_DECODE": "4"}, str(tmp_path / model_type)) \
            == {"method": method, "num_speculative_tokens": 4}
    assert settings.check({"DEEPINFER_ENABLE_MTP_VARLEN": "1"}, platform_device="cpu") == [
        "DEEPINFER_ENABLE_MTP_VARLEN: confidence-scheduled verification"]
    with pytest.raises(settings.DeepInferSettingError, match="positive number of draft tokens"):
        settings.check({"DEEPINFER_USE_NEXTN_DECODE": "many"}, platform_device="cpu")


def test_accelerator_checked_against_platform():
    settings.check({"DEEPINFER_ACCELERATOR": "cpu"}, platform_device="cpu")
    settings.check({"DEEPINFER_ACCELERATOR": "nvidia"}, platform_device="cuda")
    with pytest.raises(settings.DeepInferSettingError, match="asks for cuda but vLLM runs on 'cpu'"):
        settings.check({"DEEPINFER_ACCELERATOR": "cuda"}, platform_device="cpu")
    with pytest.raises(settings.DeepInferSettingError, match="unknown"):
        settings.check({"DEEPINFER_ACCELERATOR": "tpu9"}, platform_device="cpu")


def test_fp8_linears_checked():
    for value in ("auto", "packed", "bf16", "0"):
        settings.check({"DEEPINFER_FP8_LINEARS": value}, platform_device="cpu")
    with pytest.raises(settings.DeepInferSettingError, match="expected auto, packed or bf16"):
        settings.check({"DEEPINFER_FP8_LINEARS": "fp4"}, platform_device="cpu")


def test_engram_device_checked():
    assert settings.check({"DEEPINFER_ENGRAM_DEVICE": "auto"}, platform_device="cuda") == ["DEEPINFER_ENGRAM_DEVICE: host"]
    assert settings.check({"DEEPINFER_ENGRAM_DEVICE": "gpu"}, platform_device="cuda") == ["DEEPINFER_ENGRAM_DEVICE: gpu"]
    with pytest.raises(settings.DeepInferSettingError, match="accepted: host, gpu, auto"):
        settings.check({"DEEPINFER_ENGRAM_DEVICE": "nvme"}, platform_device="cpu")
    assert settings.check({"DEEPINFER_ENGRAM_SHARED": "0"}) == ["DEEPINFER_ENGRAM_SHARED: one copy per rank"]
    assert settings.check({"DEEPINFER_ENGRAM_SHARED": "auto"}) == ["DEEPINFER_ENGRAM_SHARED: one node-shared copy"]
    with pytest.raises(settings.DeepInferSettingError, match="accepted: auto, 1, 0"):
        settings.check({"DEEPINFER_ENGRAM_SHARED": "sometimes"})


def test_yoco_settings_map_to_bounded_replay():
    for value in ("compact", "none", "0"):
        settings.check({"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": value}, platform_device="cpu")
    for value in ("140", "exact", "0"):
        settings.check({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": value}, platform_device="cpu")
    with pytest.raises(settings.DeepInferSettingError, match="expected compact or none"):
        settings.check({"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "sparse"}, platform_device="cpu")
    with pytest.raises(settings.DeepInferSettingError, match="positive token count"):
        settings.check({"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "-5"}, platform_device="cpu")


def test_hf_model_dir_maps_to_model(tmp_path, monkeypatch):
    with pytest.raises(settings.DeepInferSettingError, match="no config.json"):
        settings.check({"DEEPINFER_HF_MODEL_DIR": str(tmp_path)})
    (tmp_path / "config.json").write_text("{}")
    settings.check({"DEEPINFER_HF_MODEL_DIR": str(tmp_path)})
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    assert settings.default_model() == str(tmp_path)
    assert settings.default_model("/explicit") == "/explicit"
    argv = ["vllm", "serve", "--port", "8000"]
    settings._map_model_into_serve_argv(argv)
    assert argv == ["vllm", "serve", str(tmp_path), "--port", "8000"]
    argv = ["vllm", "serve", "/other", "--port", "8000"]
    settings._map_model_into_serve_argv(argv)
    assert argv[2] == "/other"


def test_every_readme_setting_has_a_decision():
    readme = {"DEEPINFER_ENABLE_MTP_VARLEN", "DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
              "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "DEEPINFER_BATCH_INVARIANT", "DEEPINFER_HF_MODEL_DIR",
              "DEEPINFER_ACCELERATOR", "DEEPINFER_NUMERICS", "DEEPINFER_FP8_LINEARS",
              "DEEPINFER_EXPERT_STORAGE", "DEEPINFER_ENGRAM_DEVICE", "DEEPINFER_ENGRAM_SHARED"}
    assert readme == set(settings.SETTINGS)
    assert all(s.reason and s.vllm_equivalent for s in settings.SETTINGS.values())


def test_batch_invariant_honoured():
    assert settings.check({"DEEPINFER_BATCH_INVARIANT": "1"}, platform_device="cpu") == [
        "DEEPINFER_BATCH_INVARIANT: batch-invariant mode"]
    assert settings.check({"DEEPINFER_BATCH_INVARIANT": "0"}, platform_device="cpu") == ["DEEPINFER_BATCH_INVARIANT: off"]
