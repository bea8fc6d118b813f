"""Every causal-LM and image-text model type of the installed transformers: HF's loss, or a clear refusal.

The sweep itself is ``tests/hf_sweep.py`` (its docstring says what each outcome checks). Here each
type is one test: ``matched``, ``refused`` (flce-policy's own error naming what the model does) and
``skipped`` (the reason listed in docs/integrations.md's table) pass; a different loss or a crash
inside a library fails.

The whole sweep takes about a minute of CPU (the Triton interpreter runs each loss); a CI matrix can split it
with ``FLCE_HF_SWEEP_SHARD=k/n`` (this job runs the types ``k, k+n, k+2n, ...`` of the sorted list).
"""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

transformers = pytest.importorskip("transformers")

import hf_sweep  # noqa: E402

from flce_policy.integrations.hf_families import FAMILIES, TRANSFORM_ATTRIBUTES, _dotted  # noqa: E402
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED  # noqa: E402

pytestmark = pytest.mark.skipif(not KERNELS_INTERPRETED, reason="the sweep runs on CPU under the Triton interpreter")


def _shard(types: list[str]) -> list[str]:
    shard = os.environ.get("FLCE_HF_SWEEP_SHARD")
    if not shard:
        return types
    k, n = (int(x) for x in shard.split("/"))
    return types[k::n]


#: model types the family table lists that the sweep must match (not refuse or skip)
MUST_MATCH = sorted(set(FAMILIES) & set(hf_sweep.model_types()) - {"gemma3n"})  # gemma3n: its towers need timm


@pytest.mark.parametrize("model_type", _shard(hf_sweep.model_types()))
def test_model_type_matches_hf_or_is_refused_clearly(model_type):
    outcome = hf_sweep.run(model_type)
    assert outcome.status != "FAILED", outcome.detail
    if model_type in MUST_MATCH:
        assert outcome.status == "matched", outcome.detail
    if outcome.status == "skipped":
        pytest.skip(outcome.detail)


def _classes_calling_head_and_loss(source: str) -> list[ast.ClassDef]:
    """The top-level classes of a modeling file whose text names both ``self.lm_head`` and
    ``self.loss_function``, each parsed from its own text (to the next top-level ``class``: a tenth of
    the file, and parsing whole files was most of this test's time); the whole file where that text does
    not parse alone (a decorator of the next class at its end, say)."""
    starts = [m.start() for m in re.finditer(r"^class ", source, re.MULTILINE)]
    pieces = [source[a:b] for a, b in zip(starts, [*starts[1:], len(source)], strict=True)]
    pieces = [p for p in pieces if "self.loss_function" in p and "self.lm_head" in p]
    try:
        trees = [ast.parse(p) for p in pieces]
    except SyntaxError:
        trees = [ast.parse(source)]
    return [node for tree in trees for node in tree.body if isinstance(node, ast.ClassDef)]


def test_transform_attributes_cover_every_name_the_installed_transformers_reads():
    # Derived from the library: every config attribute any *For{CausalLM,ConditionalGeneration}.forward
    # reads between its lm_head call and self.loss_function is in TRANSFORM_ATTRIBUTES, or is one of the
    # names listed here, which are not config transforms (module attributes the forward guard inspects).
    not_config = {"get_text_config", "get_decoder", "config", "decoder", "training", "max_inference_chunksize"}
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found: dict[str, str] = {}
    for path in glob.glob(os.path.join(root, "*", "modeling_*.py")):
        with open(path) as f:
            source = f.read()
        if "self.loss_function" not in source or "self.lm_head(" not in source:
            continue
        for cls in _classes_calling_head_and_loss(source):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"):
                calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
                heads = [c.lineno for c in calls if (_dotted(c.func) or "").startswith("self.lm_head")]
                losses = [c.lineno for c in calls if _dotted(c.func) == "self.loss_function"]
                if not heads or not losses:
                    continue
                start, end = min(heads), min([x for x in losses if x >= min(heads)], default=0)
                chains = {
                    _dotted(node)
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Attribute) and start <= node.lineno < end
                }
                chains = {c for c in chains if c and c.startswith("self.") and not c.startswith("self.lm_head")}
                for chain in chains:
                    if not any(other.startswith(chain + ".") for other in chains):  # the whole chain's name
                        found.setdefault(chain.rsplit(".", 1)[-1].removesuffix("()"), cls.name)
    assert "final_logit_softcapping" in found and "logits_scaling" in found  # the scan sees what it should
    missing = {n: c for n, c in found.items() if n not in TRANSFORM_ATTRIBUTES and n not in not_config}
    # model attributes (self.logit_scale, self.model.lm_head_multiplier) carry their config attribute's name;
    # the module-held ones (vocabulary masks, softcap modules) are refused by the forward guard
    module_held = {"image_tokens", "_get_feat_extract_output_lengths"}
    assert set(missing) <= module_held, missing


def test_the_docs_table_lists_the_matched_types_and_groups_the_rest_by_reason():
    long_reason = "not built tiny: ValueError: " + "x" * 300
    outcomes = [
        hf_sweep.Outcome("alpha", "matched", "loss 7.1"),
        hf_sweep.Outcome("bravo", "refused", "ValueError: BravoForCausalLM.forward: no loss | here"),
        hf_sweep.Outcome("charlie", "skipped", long_reason),
        hf_sweep.Outcome("delta", "refused", "ValueError: DeltaModel.forward: no loss | here"),
        hf_sweep.Outcome("echo", "matched", "loss 6.9"),
        hf_sweep.Outcome(
            "foxtrot", "skipped", "not built tiny: SomeValidationError: validator 'v' failed: ValueError: the\ncause"
        ),
    ]
    lines = hf_sweep.markdown(outcomes).splitlines()
    assert "(2 matched, 2 refused, 2 skipped, 0 FAILED of 6)" in lines[0]
    assert "**matched** (2): `alpha`, `echo`." in lines
    # one row for the refusal both types share, its class name said generically and its pipe escaped
    assert r"| refused | `bravo`, `delta` | ValueError: its forward: no loss \| here |" in lines
    # a wrapped error shows its innermost one, which names the cause
    assert "| skipped | `foxtrot` | not built tiny: ValueError: the cause |" in lines
    (skipped,) = [line for line in lines if line.startswith("| skipped | `charlie`")]
    shown = skipped.split(" | ")[2].removesuffix(" |")
    assert len(shown) == hf_sweep.REASON_CHARS and shown.endswith("…") and long_reason.startswith(shown[:-1])
