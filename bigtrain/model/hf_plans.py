"""The parallel plans a transformers family declares on its config, in bigtrain's terms.

transformers (5.x) gives every model class its own plans: `base_model_tp_plan` (which linear
layers tensor parallelism splits, and how), `base_model_pp_plan` (the embedding, the decoder
layers and the final norm, in order: where pipeline stages cut) and, for mixture-of-experts
families, `base_model_ep_plan` (the stacked experts and their dispatch). bigtrain reads them
instead of keeping a table of families: a family transformers adds with its plans trains on
bigtrain's layouts without a change here.

`family_plans` turns them into what bigtrain's `parallelize()` applies:
- `tp`: patterns inside one decoder layer (`layers.*.self_attn.q_proj` -> `self_attn.q_proj`)
  to a style of TP_STYLES (parallel/tensor/plans.py runs them on torch's styles);
- `stages`: the decoder layers' container and the modules only the first and only the last
  stage run (parallel/pipeline/split.py);
- `ep`: the experts' entries, as declared.

GPT-2 declares no plans; its layers are transformers `Conv1D`s with a fused q/k/v, split by
bigtrain's own plan (GPT2_TP_PLAN) and stage spec. A family that declares no plan for a
requested layout stops the run with the family and the layout named (`require`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from bigtrain.config.parallel import TP_STYLES
from bigtrain.errors import ConfigError

GPT2_TP_PLAN = {
    "attn.c_attn": "colwise_qkv",
    "attn.c_proj": "rowwise",
    "mlp.c_fc": "colwise",
    "mlp.c_proj": "rowwise",
}
"""bigtrain's plan for GPT-2, which declares none (its Conv1D layers: parallel/tensor/conv1d.py)."""

GPT2_STAGES = (
    "hf.transformer.h",
    ("hf.transformer.wte", "hf.transformer.wpe"),
    ("hf.transformer.ln_f", "hf.lm_head"),
)


@dataclass(frozen=True)
class FamilyPlans:
    """A transformers family's plans, as bigtrain applies them (module docstring)."""

    model_type: str
    tp: dict[str, str] = field(default_factory=dict)
    """Patterns inside a decoder layer -> a TP_STYLES name; empty: none declared."""
    stages: tuple[str, tuple[str, ...], tuple[str, ...]] | None = None
    """(decoder layers' container, first stage's modules, last stage's modules), as paths under
    bigtrain's wrapper (`hf.model.layers`); None: no pipeline plan declared."""
    ep: dict[str, str] = field(default_factory=dict)
    """The experts' entries inside a decoder layer, as declared; empty: a dense family."""
    own: bool = False
    """bigtrain's plans (GPT-2), not declared by transformers."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Declared tensor-parallel entries outside the decoder layers (an embedding split), which
    bigtrain leaves whole."""
    layers: str = "model.layers"
    """The decoder layers' container, as a path under the transformers model."""

    @property
    def source(self) -> str:
        return "bigtrain's own plan" if self.own else "declared by transformers"


def family_plans(hf_model: Any) -> FamilyPlans:
    """The plans of a transformers `*ForCausalLM` (its class and config)."""
    config = hf_model.config
    model_type = config.model_type
    if model_type == "gpt2":
        return FamilyPlans(
            "gpt2", dict(GPT2_TP_PLAN), GPT2_STAGES, own=True, layers="transformer.h"
        )
    prefix = getattr(hf_model, "base_model_prefix", "model") or "model"
    pp = dict(getattr(config, "base_model_pp_plan", None) or {})
    layers = next((k for k, (inputs, _) in pp.items() if "hidden_states" in inputs), "layers")
    stages = None
    if pp:
        names = list(pp)
        at = names.index(layers)
        stages = (
            f"hf.{prefix}.{layers}",
            tuple(f"hf.{prefix}.{n}" for n in names[:at]),
            (*(f"hf.{prefix}.{n}" for n in names[at + 1 :]), "hf.lm_head"),
        )
    tp, skipped = _in_layers(getattr(config, "base_model_tp_plan", None) or {}, layers)
    ep, _ = _in_layers(getattr(config, "base_model_ep_plan", None) or {}, layers)
    return FamilyPlans(model_type, tp, stages, ep, skipped=skipped, layers=f"{prefix}.{layers}")


def _in_layers(plan: dict[str, str], layers: str) -> tuple[dict[str, str], dict[str, str]]:
    """(entries inside a decoder layer, relative to it; the others)."""
    inside, outside = {}, {}
    head = f"{layers}.*."
    for key, style in plan.items():
        if key.startswith(head):
            inside[key[len(head) :]] = style
        else:
            outside[key] = style
    return inside, outside


EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")
"""The declared expert-parallel styles bigtrain runs (parallel/experts.py): stacked expert
weights split by expert, and the experts module whose tokens are dispatched to their ranks."""

LAYOUT_PLAN = {
    "parallel.tensor_parallel": ("tp", "base_model_tp_plan"),
    "parallel.pipeline_parallel": ("stages", "base_model_pp_plan"),
    "parallel.expert_parallel": ("ep", "base_model_ep_plan"),
}
"""A layout's key -> (the FamilyPlans field it needs, the config attribute that declares it)."""


def require(plans: FamilyPlans, key: str, degree: int | None = None) -> None:
    """A ConfigError (exit 2) naming the family and the layout when the family declares no plan
    for it, or a tensor-parallel style bigtrain does not run. `degree`: the key's value, when
    known (the planner asks without one)."""
    what, declared = LAYOUT_PLAN[key]
    named = f"key '{key}'" + (f" ({degree})" if degree is not None else "")
    if not getattr(plans, what):
        raise ConfigError(
            f"{named}: the transformers family {plans.model_type!r} declares no {declared} "
            f"(transformers {_version()}), so bigtrain does not know how to split it that way; "
            f"use {key}=1" + (", or give parallel.tp_plan" if what == "tp" else "")
        )
    runs = {"tp": TP_STYLES, "ep": EP_STYLES}.get(what, ())
    declared_styles = getattr(plans, what) if runs else {}
    unknown = {k: s for k, s in declared_styles.items() if s not in runs}
    if unknown:
        kind = "tensor" if what == "tp" else "expert"
        hint = "give parallel.tp_plan, or " if what == "tp" else ""
        raise ConfigError(
            f"{named}: the transformers family {plans.model_type!r} declares {kind}-parallel "
            f"styles bigtrain does not run: {unknown} (it runs {', '.join(runs)}); {hint}"
            f"use {key}=1"
        )


def _version() -> str:
    import transformers

    return transformers.__version__


def family_experts(hf_model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """The experts modules a family's ep plan declares (`ep_dispatch_experts`) in module order:
    (path under the transformers model, module, its stacked weights' names: the `grouped_gemm`
    entries). Empty for a dense family, and for a dense layer of an MoE family (DeepSeek-V3's
    first). A decoder layer wrapped for activation checkpointing matches too."""
    plans = family_plans(hf_model)
    dispatch = [rel for rel, style in plans.ep.items() if style == "ep_dispatch_experts"]
    out = []
    for name, module in hf_model.named_modules():
        rel = next(
            (r for r in dispatch if fnmatch.fnmatchcase(name, f"{plans.layers}.*.{r}")), None
        )
        if rel is not None:
            weights = [
                w
                for w, _ in module.named_parameters(recurse=False)
                if plans.ep.get(f"{rel}.{w}") == "grouped_gemm"
            ]
            out.append((name, module, weights))
    return out


def experts_per_token(hf_model: nn.Module) -> int:
    """The experts each token goes through in a family's MoE layers (its config's top k)."""
    config = hf_model.config
    for key in ("num_experts_per_tok", "moe_topk", "top_k"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError(
        f"the transformers family {config.model_type!r} declares experts but its config states "
        "no experts per token (num_experts_per_tok): bigtrain cannot count its active parameters"
    )
