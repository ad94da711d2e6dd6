"""DeepInfer's `so_args` (structured-output arguments) → vLLM `StructuredOutputsParams`.

Accepted keys (exactly one constraint key; the options may accompany it):

| so_args key | vLLM field | value |
|---|---|---|
| `json` / `json_schema` | `json` | JSON schema (dict or JSON string) |
| `regex` | `regex` | regular expression |
| `grammar` / `ebnf` | `grammar` | EBNF (xgrammar / GBNF syntax) |
| `choice` | `choice` | list of strings |
| `json_object` | `json_object` | `True`: any JSON object |
| `structural_tag` | `structural_tag` | xgrammar structural tag (dict or JSON string) |
| `disable_any_whitespace`, `disable_additional_properties`, `whitespace_pattern` | same | options |

Any other key is rejected with a `ValueError` naming the accepted ones (never silently ignored:
an ignored constraint means unconstrained output).
"""

from __future__ import annotations

import json
from typing import Any

CONSTRAINT_KEYS = {
    "json": "json",
    "json_schema": "json",
    "regex": "regex",
    "grammar": "grammar",
    "ebnf": "grammar",
    "choice": "choice",
    "json_object": "json_object",
    "structural_tag": "structural_tag",
}
OPTION_KEYS = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}


class SoArgsError(ValueError):
    pass


def to_structured_outputs(so_args: Any):
    """Map a DeepInfer `so_args` dict to vLLM's `StructuredOutputsParams` (validated shape)."""
    from vllm.sampling_params import StructuredOutputsParams

    if not isinstance(so_args, dict):
        raise SoArgsError(f"so_args must be a dict, got {type(so_args).__name__}")
    unknown = sorted(set(so_args) - set(CONSTRAINT_KEYS) - OPTION_KEYS)
    if unknown:
        raise SoArgsError(
            f"unknown so_args key(s) {unknown}; accepted: "
            f"{sorted(CONSTRAINT_KEYS)} (one of) plus options {sorted(OPTION_KEYS)}"
        )
    constraints = [k for k in so_args if k in CONSTRAINT_KEYS and so_args[k] is not None]
    if len(constraints) != 1:
        raise SoArgsError(
            f"so_args needs exactly one constraint key out of {sorted(CONSTRAINT_KEYS)}; got {constraints or 'none'}"
        )
    key = constraints[0]
    value = so_args[key]
    field = CONSTRAINT_KEYS[key]
    if field == "json" and not isinstance(value, (dict, str)):
        raise SoArgsError("so_args['json'] must be a JSON schema (dict or JSON string)")
    if field in ("regex", "grammar") and not isinstance(value, str):
        raise SoArgsError(f"so_args[{key!r}] must be a string")
    if field == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
        raise SoArgsError("so_args['choice'] must be a non-empty list of strings")
    if field == "json_object" and value is not True:
        raise SoArgsError("so_args['json_object'] must be True")
    if field == "structural_tag" and isinstance(value, dict):
        value = json.dumps(value)
    kwargs = {field: value}
    kwargs.update({k: so_args[k] for k in OPTION_KEYS if k in so_args})
    return StructuredOutputsParams(**kwargs)
