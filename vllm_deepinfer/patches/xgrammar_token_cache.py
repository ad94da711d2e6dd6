"""Compile grammars that contain token-level elements without xgrammar's cross-grammar cache.

Reason: xgrammar 0.2.8's `GrammarCompiler(cache_enabled=True)` shares rule-level token masks
between grammars whose rule FSMs hash equal, and that hash ignores *which* token id a token
edge (`Token(…)`, from a structural tag `{"type": "token", "token": N}` element, or
`ExcludeToken(…)` / `TokenTagDispatch(…)`) matches. After a compiler has compiled one grammar
with a rule `Token(8187)`, a later grammar with the same-shaped rule `Token(8178)` gets the first
grammar's mask: the bitmask lets the sampler take 8187 where the matcher only accepts 8178, and
vLLM's scheduler then fails the request ("Unexpected: grammar rejected tokens [8187]",
`vllm/v1/core/sched/scheduler.py:2186`, HTTP 500). xgrammar alone, same sequence, passes only
because a fresh compiler has an empty cache; with `cache_enabled=False` the masks are right.
Reproduced with xgrammar alone: `compile_grammar('root ::= "a" Token(8178)')` then
`compile_grammar('root ::= "a" Token(8187)')` on one cached compiler → the second matcher allows
8178 after "a" (shape-different rules, e.g. `"a" Token(8178) "zz"`, do not collide).

vLLM 0.32.0 builds one cached compiler per engine (`XgrammarBackend.__post_init__`,
`vllm/v1/structured_output/backend_xgrammar.py:73-78`, `cache_enabled=True`) and compiles every
request's grammar with it (`compile_grammar`, same file line 86; structural tags at line 147,
EBNF at line 127). So any server that sees two token-element grammars with different token ids
(e.g. a tool call forced with `<｜DSML｜ calls>` after one forced with `</think>`, or vLLM's own
DSML structural tags) can fail requests. It is not the reasoning gate: with
`enable_in_reasoning` the gate constrains from the first token
(`vllm/v1/structured_output/__init__.py:248-249`), and the wrong mask comes from the matcher.

Change: `XgrammarBackend.compile_grammar` is wrapped; a structural tag or EBNF/Lark grammar whose
(converted) grammar contains a token-level construct is compiled by a second compiler of the same
tokenizer info with `cache_enabled=False` (otherwise unchanged: same options, same matcher).
Grammars without token edges keep the cached compiler; since token-edge rules never enter its
cache, they cannot be served a wrong mask from it. Cost: token-element grammars are compiled
from scratch each time (milliseconds for the small structural tags involved).
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading

from vllm_deepinfer.log import get_logger

logger = get_logger(__name__)

_PATCHED = "_deepinfer_xgrammar_token_cache"
# Token-level constructs as xgrammar prints them in a grammar (never right after a quote).
_TOKEN_EDGE = re.compile(r'(?<!["\w])(?:Token|ExcludeToken|TokenTagDispatch)\s*\(')
_lock = threading.Lock()


def uses_token_edges(request_type, grammar_spec: str) -> bool:
    """Whether the grammar of this request contains a token-level element (a false positive only
    costs caching)."""
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions

    if request_type == StructuredOutputOptions.GRAMMAR:
        return bool(_TOKEN_EDGE.search(grammar_spec))
    if request_type != StructuredOutputOptions.STRUCTURAL_TAG:
        return False
    try:
        if "structures" in json.loads(grammar_spec):
            return False  # deprecated begin/schema/end form: no token elements
        text = str(xgr.Grammar.from_structural_tag(grammar_spec))
    except Exception:  # noqa: BLE001 - let the real compile report the error
        return False
    return bool(_TOKEN_EDGE.search(text))


def _uncached_backend(backend):
    """A shallow copy of `backend` whose compiler has the cross-grammar cache off."""
    proxy = getattr(backend, "_deepinfer_uncached", None)
    if proxy is not None:
        return proxy
    import xgrammar as xgr

    with _lock:
        proxy = getattr(backend, "_deepinfer_uncached", None)
        if proxy is None:
            # The tokenizer info the backend built (mistral / plamo3 / HF paths alike).
            info = backend.compiler.compile_grammar('root ::= "a"').tokenizer_info
            proxy = copy.copy(backend)
            proxy.compiler = xgr.GrammarCompiler(info, max_threads=8, cache_enabled=False)
            backend._deepinfer_uncached = proxy
    return proxy


def apply() -> None:
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    original = XgrammarBackend.compile_grammar
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def compile_grammar(self, request_type, grammar_spec, stop_token_ids=None):
        if uses_token_edges(request_type, grammar_spec):
            logger.debug("token-level grammar: compiling without xgrammar's cross-grammar cache")
            return original(_uncached_backend(self), request_type, grammar_spec, stop_token_ids=stop_token_ids)
        return original(self, request_type, grammar_spec, stop_token_ids=stop_token_ids)

    setattr(compile_grammar, _PATCHED, True)
    XgrammarBackend.compile_grammar = compile_grammar
