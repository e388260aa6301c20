"""AutoTP over ~50 tiny Hugging Face causal LMs (needs transformers): each sharded on 2 ranks by
`shard_model` against the dense model over 2 SGD steps (loss and every gradient); prints OK, WRONG (a
mismatch: a bug), REFUSED (a clear error: a family not built) or CRASH per family.

    python -m tests.fuzz.autotp_families [family ...]"""
import copy
import sys
import torch
from tests.harness import run_distributed

V, H, NH, KV, L, I = 64, 32, 4, 2, 2, 64
COMMON = dict(vocab_size=V, hidden_size=H, num_attention_heads=NH, num_hidden_layers=L, intermediate_size=I,
              max_position_embeddings=32)

def cfgs():
    import transformers as t
    c = {}
    def add(name, cls_cfg, cls_model, **kw):
        c[name] = (getattr(t, cls_cfg, None), getattr(t, cls_model, None), kw)
    add("gpt2", "GPT2Config", "GPT2LMHeadModel", vocab_size=V, n_embd=H, n_head=NH, n_layer=L, n_positions=32)
    add("gpt_neo", "GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=V, hidden_size=H, num_heads=NH, num_layers=L,
        attention_types=[[["global", "local"], 1]], max_position_embeddings=32, window_size=8)
    add("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", **COMMON)
    add("gptj", "GPTJConfig", "GPTJForCausalLM", vocab_size=V, n_embd=H, n_head=NH, n_layer=L, n_positions=32, rotary_dim=4)
    add("opt", "OPTConfig", "OPTForCausalLM", vocab_size=V, hidden_size=H, num_attention_heads=NH, num_hidden_layers=L,
        ffn_dim=I, max_position_embeddings=32, word_embed_proj_dim=H)
    add("bloom", "BloomConfig", "BloomForCausalLM", vocab_size=V, hidden_size=H, n_head=NH, n_layer=L)
    add("falcon", "FalconConfig", "FalconForCausalLM", vocab_size=V, hidden_size=H, num_attention_heads=NH, num_hidden_layers=L)
    add("falcon_mq", "FalconConfig", "FalconForCausalLM", vocab_size=V, hidden_size=H, num_attention_heads=NH,
        num_hidden_layers=L, multi_query=True, new_decoder_architecture=False)
    add("llama", "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=KV, **COMMON)
    add("llama_kv1", "LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1, **COMMON)
    add("qwen3_kv1", "Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=1, head_dim=8, **COMMON)
    add("phi3_kv1", "Phi3Config", "Phi3ForCausalLM", num_key_value_heads=1, pad_token_id=0, **COMMON)
    add("mistral", "MistralConfig", "MistralForCausalLM", num_key_value_heads=KV, **COMMON)
    add("mixtral", "MixtralConfig", "MixtralForCausalLM", num_key_value_heads=KV, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    add("qwen2", "Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=KV, **COMMON)
    add("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=KV, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32, **COMMON)
    add("qwen3", "Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_key_value_heads=KV, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, **COMMON)
    add("phi", "PhiConfig", "PhiForCausalLM", num_key_value_heads=NH, **COMMON)
    add("phi3", "Phi3Config", "Phi3ForCausalLM", num_key_value_heads=KV, pad_token_id=0, **COMMON)
    add("gemma", "GemmaConfig", "GemmaForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("gemma2", "Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("stablelm", "StableLmConfig", "StableLmForCausalLM", num_key_value_heads=KV, **COMMON)
    add("olmo", "OlmoConfig", "OlmoForCausalLM", num_key_value_heads=KV, pad_token_id=0, **COMMON)
    add("olmo2", "Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=KV, pad_token_id=0, **COMMON)
    add("cohere", "CohereConfig", "CohereForCausalLM", num_key_value_heads=KV, pad_token_id=0, **COMMON)
    add("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=KV, **COMMON)
    add("bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=V, n_embd=H, n_head=NH, n_layer=L, n_positions=32)
    add("codegen", "CodeGenConfig", "CodeGenForCausalLM", vocab_size=V, n_embd=H, n_head=NH, n_layer=L, n_positions=32, rotary_dim=4, n_ctx=32)
    add("persimmon", "PersimmonConfig", "PersimmonForCausalLM", **COMMON)
    add("granite", "GraniteConfig", "GraniteForCausalLM", num_key_value_heads=KV, **COMMON)
    add("nemotron", "NemotronConfig", "NemotronForCausalLM", num_key_value_heads=KV, **COMMON)
    add("glm", "GlmConfig", "GlmForCausalLM", num_key_value_heads=KV, head_dim=8, pad_token_id=0, **COMMON)
    add("helium", "HeliumConfig", "HeliumForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("mpt", "MptConfig", "MptForCausalLM", vocab_size=V, d_model=H, n_heads=NH, n_layers=L, max_seq_len=32)
    add("exaone4", "Exaone4Config", "Exaone4ForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", num_key_value_heads=KV, **COMMON)
    add("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("seed_oss", "SeedOssConfig", "SeedOssForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("ernie45", "Ernie4_5Config", "Ernie4_5ForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("olmo3", "Olmo3Config", "Olmo3ForCausalLM", num_key_value_heads=KV, pad_token_id=0, **COMMON)
    add("apertus", "ApertusConfig", "ApertusForCausalLM", num_key_value_heads=KV, **COMMON)
    add("arcee", "ArceeConfig", "ArceeForCausalLM", num_key_value_heads=KV, **COMMON)
    add("bitnet", "BitNetConfig", "BitNetForCausalLM", num_key_value_heads=KV, **COMMON)
    add("hunyuan", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", num_key_value_heads=KV, head_dim=8, **COMMON)
    add("dots1", "Dots1Config", "Dots1ForCausalLM", num_key_value_heads=KV, **COMMON)
    add("minimax", "MiniMaxConfig", "MiniMaxForCausalLM", num_key_value_heads=KV, num_local_experts=4, **COMMON)
    add("bert", "BertConfig", "BertLMHeadModel", vocab_size=V, hidden_size=H, num_attention_heads=NH, num_hidden_layers=L,
        intermediate_size=I, is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    add("xglm", "XGLMConfig", "XGLMForCausalLM", vocab_size=V, d_model=H, attention_heads=NH, num_layers=L, ffn_dim=I)
    add("biogpt", "BioGptConfig", "BioGptForCausalLM", **COMMON)
    add("mamba", "MambaConfig", "MambaForCausalLM", vocab_size=V, hidden_size=H, num_hidden_layers=L, state_size=4)
    add("recurrent_gemma", "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", vocab_size=V, hidden_size=H,
        num_attention_heads=NH, num_hidden_layers=3, intermediate_size=I, lru_width=H, attention_window_size=8, head_dim=8)
    add("jamba", "JambaConfig", "JambaForCausalLM", num_key_value_heads=KV, num_experts=2, **COMMON)
    add("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=NH, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_group=1, topk_group=1, **COMMON)
    return c

def one(name):
    from engine.comm import Communicator
    from engine.tensor_parallel.autotp import shard_model
    from engine.tensor_parallel import is_partitioned
    from engine.tensor_parallel.layers import shard
    comm = Communicator(None)
    ccls, mcls, kw = cfgs()[name]
    if ccls is None or mcls is None:
        return "absent"
    torch.manual_seed(0)
    try:
        conf = ccls(**kw)
        for k in ("hidden_dropout", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
                  "hidden_dropout_prob", "attention_probs_dropout_prob", "residual_dropout"):
            if hasattr(conf, k): setattr(conf, k, 0.0)
        model = mcls(conf)
    except Exception as e:
        return f"build failed: {type(e).__name__}: {str(e)[:150]}"
    model.train()
    ref = copy.deepcopy(model)
    try:
        shard_model(model, comm)
    except Exception as e:
        return f"REFUSED at shard: {type(e).__name__}: {str(e)[:300]}"
    dense = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    def sl(p, full):
        if getattr(p, "tensor_parallel_transposed", False):  # a Conv1D shard is kept (out, in)
            full = full.t()
        return shard(full, p.tensor_parallel_dim, comm.rank, comm.world_size, p.tensor_parallel_parts) if is_partitioned(p) else full
    lerr, gerr = 0.0, {}
    nshard = sum(is_partitioned(p) for p in model.parameters())
    try:
        for step in range(2):
            ids = torch.randint(1, V, (2, 12), generator=g)
            losses = [m(input_ids=ids, labels=ids).loss for m in (model, ref)]
            for l in losses: l.backward()
            lerr = max(lerr, abs(losses[0].item() - losses[1].item()))
            if step == 0:
                for n, p in model.named_parameters():
                    if p.grad is None and dense[n].grad is None: continue
                    if p.grad is None or dense[n].grad is None:
                        gerr[n] = float("inf"); continue
                    gerr[n] = (p.grad - sl(p, dense[n].grad)).abs().max().item()
            for o in opts: o.step(); o.zero_grad()
    except Exception as e:
        return f"REFUSED at run: {type(e).__name__}: {str(e)[:300]}"
    worst = sorted(gerr.items(), key=lambda kv: -kv[1])[:3]
    status = "OK" if lerr < 1e-5 and all(v < 1e-5 for _, v in worst) else "WRONG"
    return f"{status} sharded {nshard} loss_err {lerr:.1e} worst grads {[(n, f'{v:.1e}') for n, v in worst]}"

def ranked(names):
    out = {}
    for n in names:
        try:
            out[n] = one(n)
        except Exception as e:
            out[n] = f"CRASH {type(e).__name__}: {str(e)[:300]}"
        torch.distributed.barrier()
    return out

if __name__ == "__main__":
    names = sys.argv[1:] or list(cfgs())
    for n in names:
        try:
            res = run_distributed(ranked, 2, args=([n],), timeout=120)
            print(n, "|", res[0][n], "|", "same" if res[0][n] == res[1][n] else f"rank1: {res[1][n]}", flush=True)
        except Exception as e:
            print(n, "| HARNESS", str(e)[-400:].replace("\n", " "), flush=True)
