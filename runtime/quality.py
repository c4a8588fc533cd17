"""How close a compiled model is to its source: teacher-forced KL divergence, top-1 agreement,
logit cosine and perplexity over many positions, as llama.cpp's `--kl-divergence` reports them.

Both models score the same windows of the same text (see `perplexity.iter_logprobs`); statistics
accumulate window by window, so memory stays at one window of logits whatever the text length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .perplexity import iter_logprobs


@dataclass(frozen=True)
class Comparison:
    """Agreement of a candidate model with a reference over `positions` scored tokens."""

    positions: int
    mean_kld: float  # mean over positions of KL(reference || candidate), nats
    max_kld: float
    kld_p99: float  # 99th percentile of the per-position KL
    top1_agreement: float  # share of positions where both models' most likely tokens agree
    mean_cosine: float  # cosine of the two final-logit vectors, mean and minimum over positions
    min_cosine: float
    perplexity_reference: float
    perplexity_candidate: float

    def to_plain(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def summary(self) -> str:
        return (f"mean KLD {self.mean_kld:.5f}, top-1 {100 * self.top1_agreement:.1f}%, "
                f"cosine {self.mean_cosine:.5f} (min {self.min_cosine:.4f}), "
                f"ppl {self.perplexity_candidate:.3f} vs {self.perplexity_reference:.3f} over {self.positions} "
                "positions")


def compare(reference, candidate, token_ids: Sequence[int] | torch.Tensor, *, context: int | None = None,
            stride: int | None = None) -> Comparison:
    """Score `candidate` against `reference` (each a ThinModel or Executor) on `token_ids`.

    Windows and strides as in `iter_logprobs`; every scored position counts once."""
    return compare_prompts(reference, candidate, [token_ids], context=context, stride=stride)


def compare_prompts(reference, candidate, prompts: Sequence[Sequence[int] | torch.Tensor], *,
                    context: int | None = None, stride: int | None = None) -> Comparison:
    """`compare` over several token sequences at once: each is scored on its own (windows as in
    `iter_logprobs`, every position after its first), and every scored position of every sequence
    counts once in the statistics."""
    klds, agree, cosines = [], 0, []
    nll_ref = nll_cand = 0.0
    for token_ids in prompts:
        windows = zip(iter_logprobs(reference, token_ids, context=context, stride=stride),
                      iter_logprobs(candidate, token_ids, context=context, stride=stride))
        for ref, cand in windows:
            p = ref.logprobs.exp()
            kld = (p * (ref.logprobs - cand.logprobs)).sum(-1).clamp_min(0)
            klds.append(kld.double())
            agree += int((ref.logprobs.argmax(-1) == cand.logprobs.argmax(-1)).sum())
            cosines.append(torch.nn.functional.cosine_similarity(ref.logits, cand.logits, dim=-1).double())
            nll_ref -= float(ref.logprobs.gather(-1, ref.targets[:, None]).double().sum())
            nll_cand -= float(cand.logprobs.gather(-1, cand.targets[:, None]).double().sum())
    kld = torch.cat(klds)
    cosine = torch.cat(cosines)
    n = kld.numel()
    return Comparison(
        positions=n, mean_kld=float(kld.mean()), max_kld=float(kld.max()),
        kld_p99=float(torch.quantile(kld, 0.99)), top1_agreement=agree / n,
        mean_cosine=float(cosine.mean()), min_cosine=float(cosine.min()),
        perplexity_reference=math.exp(nll_ref / n), perplexity_candidate=math.exp(nll_cand / n))
