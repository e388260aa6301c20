"""`SparseAttentionUtils`: DeepSpeed's helpers to fit a model's inputs to the block size."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SparseAttentionUtils:
    @staticmethod
    def pad_to_block_size(block_size, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          pad_token_id, model_embeddings):
        """Right-pad every given input to a multiple of `block_size`; padded positions are masked
        out (attention_mask 0) and get `pad_token_id`'s embedding. Returns (pad_len, input_ids,
        attention_mask, token_type_ids, position_ids, inputs_embeds)."""
        shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
        seq_len = shape[1]
        pad_len = (block_size - seq_len % block_size) % block_size
        if pad_len == 0:
            return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
        if input_ids is not None:
            input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
        if inputs_embeds is not None:
            pad_ids = inputs_embeds.new_full((shape[0], pad_len), pad_token_id, dtype=torch.long)
            inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids)], dim=-2)
        attention_mask = F.pad(attention_mask, (0, pad_len), value=0) if attention_mask is not None else None
        token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0) if token_type_ids is not None else None
        position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id) if position_ids is not None else None
        return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds

    @staticmethod
    def unpad_sequence_output(pad_len, sequence_output):
        """Drop the `pad_len` positions `pad_to_block_size` added."""
        return sequence_output[:, :-pad_len] if pad_len > 0 else sequence_output

    @staticmethod
    def extend_position_embedding(model, max_position):
        """Grow a BERT/RoBERTa-style `embeddings.position_embeddings` to `max_position` rows by repeating
        the trained ones (RoBERTa's first 2 rows are its padding offset and stay first)."""
        embeddings = model.embeddings if hasattr(model, "embeddings") else model.bert.embeddings
        old = embeddings.position_embeddings.weight
        offset = 2 if "roberta" in type(model).__name__.lower() else 0
        trained = old[offset:]
        reps = -(-(max_position - offset) // trained.shape[0])
        new_weight = torch.cat([old[:offset], trained.repeat(reps, 1)[:max_position - offset]])
        embeddings.position_embeddings = nn.Embedding.from_pretrained(new_weight.detach().clone(), freeze=False)
        if hasattr(model, "config"):
            model.config.max_position_embeddings = max_position
        return model
