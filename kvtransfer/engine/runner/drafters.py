"""Speculative proposers, run by the model runner right after sampling.

`DraftModelProposer` runs a smaller model that keeps its own KV layers in the target's block
tables: each step it first catches its cache up on exactly the tokens the target kept, then
proposes greedily. Its layers go through the same connector hooks as the target's, so their KV
is saved (and later transferred) with the request's blocks. `NgramProposer` looks the proposal
up in the request's own history and writes no KV.
"""

from __future__ import annotations

import torch

from kvtransfer.engine.model.forward_context import LayerHooks
from kvtransfer.engine.model.llama import LlamaForCausalLM
from kvtransfer.engine.runner.input_batch import SequenceChunk, build_forward_batch
from kvtransfer.engine.runner.model_runner import Comm, StepResult
from kvtransfer.engine.runner.request_states import RequestStates
from kvtransfer.engine.spec_decode import NgramProposer


class DraftModelProposer:
    def __init__(
        self,
        drafter: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        hooks: LayerHooks,
        comm: Comm,
        requests: RequestStates,
        *,
        num_speculative_tokens: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.drafter = drafter
        self.kv_caches = kv_caches
        self.hooks = hooks
        self.comm = comm
        self.requests = requests
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.device = device

    def propose(self, step: StepResult) -> dict[str, list[int]]:
        chunks, proposing = [], []
        for request in step.requests:
            chunk = request.chunk
            kept = step.accepted.get(request.req_id)
            if kept is not None:
                # Inputs whose target KV stays valid, then the newest token (not yet in KV).
                num_valid = len(chunk.token_ids) - request.num_drafts + len(kept) - 1
                chunk = SequenceChunk(
                    [*chunk.token_ids[:num_valid], kept[-1]], chunk.start_position, chunk.block_ids
                )
                proposing.append(len(chunks))
            chunks.append(chunk)
        batch = build_forward_batch(chunks, self.block_size, self.device)
        hidden = self.drafter(
            batch.input_ids, batch.positions, self.kv_caches, batch.attn_metadata, hooks=self.hooks
        )
        if not proposing:
            return {}
        next_tokens = self._greedy(hidden[batch.last_rows[proposing]])
        proposals = {
            step.requests[i].req_id: [t] for i, t in zip(proposing, next_tokens, strict=True)
        }
        # Each further proposal writes the previous one's KV; stop where the block table ends.
        for depth in range(1, self.num_speculative_tokens):
            decode = []
            for i in proposing:
                req_id = step.requests[i].req_id
                position = chunks[i].start_position + len(chunks[i].token_ids) + depth - 1
                if position < len(chunks[i].block_ids) * self.block_size:
                    decode.append(
                        (
                            req_id,
                            SequenceChunk([proposals[req_id][-1]], position, chunks[i].block_ids),
                        )
                    )
            if not decode:
                break
            batch = build_forward_batch([c for _, c in decode], self.block_size, self.device)
            hidden = self.drafter(
                batch.input_ids,
                batch.positions,
                self.kv_caches,
                batch.attn_metadata,
                hooks=self.hooks,
            )
            for (req_id, _), token in zip(decode, self._greedy(hidden), strict=True):
                proposals[req_id].append(token)
            proposing = [i for i in proposing if step.requests[i].req_id in dict(decode)]
        return proposals

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        tokens = self.drafter.compute_logits(hidden).argmax(dim=-1)
        return self.comm.tp_broadcast_tokens(tokens).tolist()


class NgramDraftProposer:
    def __init__(self, ngram: NgramProposer, requests: RequestStates) -> None:
        self.ngram = ngram
        self.requests = requests

    def propose(self, step: StepResult) -> dict[str, list[int]]:
        proposals = {}
        for req_id, kept in step.accepted.items():
            history = [*self.requests[req_id].token_ids, *kept]
            drafts = self.ngram.propose(history, self.ngram.num_speculative_tokens)
            if drafts:
                proposals[req_id] = drafts
        return proposals
