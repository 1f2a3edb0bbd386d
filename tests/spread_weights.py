"""Random weights for reference models whose greedy decoding a test compares token by token."""

import torch


@torch.no_grad()
def spread_weights_(model: torch.nn.Module) -> None:
    """Norms at 1 ± 0.2, everything else N(0, 0.3), in place: large weights spread the
    logits, so greedy never hinges on a float32 near-tie (a trained model's initialisation,
    N(0, 0.02), leaves many)."""
    for name, p in model.named_parameters():
        p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
