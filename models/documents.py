"""Documents packed into one sequence: positions that restart after each end-of-document token,
and the attention mask that keeps every token inside its own document (Megatron's
--reset-position-ids and --reset-attention-mask)."""

from __future__ import annotations

import torch


def document_layout(tokens: torch.Tensor, eod_token: int):
    """For token ids [batch, seq]: (document ids, positions), both [batch, seq]. A document ends
    with its end-of-document token; the next one starts after it, at position 0."""
    ends = (tokens == eod_token).long()
    documents = torch.cumsum(ends, dim=1) - ends  # the eod token belongs to the document it ends
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(tokens)
    starts[:, 1:] = ends[:, :-1] * index[:, 1:]  # a document starts right after an eod token
    positions = index - torch.cummax(starts, dim=1).values
    return documents, positions


def document_attention_mask(documents: torch.Tensor) -> torch.Tensor:
    """[batch, 1, seq, seq] boolean: query i may attend key j iff j <= i in the same document."""
    same = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(
        documents.shape[1], documents.shape[1], dtype=torch.bool, device=documents.device
    ).tril()
    return (same & causal)[:, None]
