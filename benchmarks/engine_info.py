"""What a running vLLM engine serves: shared by the device benchmark scripts."""

from __future__ import annotations


def describe(llm) -> dict[str, str | None]:
    """The resolved architecture and the class that serves it (the plugin's or vLLM's in-tree one)."""
    mc = llm.llm_engine.model_config
    info: dict[str, str | None] = {"architecture": getattr(mc, "architecture", None)}
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        info["model_class"] = str(ModelRegistry._try_load_model_cls(mc.architecture))
    except Exception as e:  # noqa: BLE001 - informational only
        info["model_class"] = f"? {e!r}"
    return info


def host_profile(call, label: str, top: int = 30) -> None:
    """cProfile `call()` (an in-process engine, so the engine core's Python is seen) and print the top
    `top` functions by own time and by cumulative time, headed by `label` and the wall time under cProfile."""
    import cProfile
    import io
    import pstats
    import time

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    call()
    prof.disable()
    wall = time.perf_counter() - t
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        print(f"== host profile ({label}, {wall:.3f} s under cProfile), by {key}\n"
              + "\n".join(buf.getvalue().splitlines()[-(top + 6):]), flush=True)
