"""The suite's strategies: each row's name, the config it runs (on bench_training's AdamW fp32 base) and
the ZeRO stage of its memory formula, with what the peers cannot run of them (benchmarks/suite.py)."""
from __future__ import annotations

from benchmarks import bench_training as bt

ADAMW = {"type": "AdamW", "params": {"lr": bt.LR}}
_ZERO = {"overlap_comm": True, "reduce_bucket_size": 5e6}
# name -> (config overrides on bench_training's AdamW fp32 base config, ZeRO stage of the memory formula).
# One model copy over both ranks (tensor parallel, pipeline): 16 sequences per step as gradient accumulation
# (benchmarks/suite_runners.py), the same global batch as the data-parallel rows.
STRATEGIES: dict[str, tuple[dict, int]] = {
    "dstrain-z0": ({"zero_optimization": {"stage": 0, **_ZERO}}, 0),
    "dstrain-z1": ({"zero_optimization": {"stage": 1, **_ZERO}}, 1),
    "dstrain-z2": ({"zero_optimization": {"stage": 2, **_ZERO}}, 2),
    "dstrain-z3": ({"zero_optimization": {"stage": 3, **_ZERO}}, 3),
    "dstrain-1bit-adam": ({"optimizer": {"type": "OneBitAdam", "params": {"lr": bt.LR, "freeze_step": 2}}}, 0),
    "dstrain-0/1-adam": ({"optimizer": {"type": "ZeroOneAdam", "params": {"lr": bt.LR, "var_freeze_step": 2,
                                                                         "local_step_scaler": 2,
                                                                         "local_step_clipper": 4}}}, 0),
    "dstrain-powersgd": ({"gradient_compression": {"type": "powersgd", "rank": 4, "start_step": 2}}, 0),
    "dstrain-z2-offload-cpu": ({"zero_optimization": {"stage": 2, **_ZERO, "offload_optimizer": {"device": "cpu"}}}, 2),
    "dstrain-z2-offload-nvme": ({"zero_optimization": {"stage": 2, **_ZERO, "offload_optimizer": {
        "device": "nvme", "nvme_path": "NVME_DIR"}}}, 2),
    "dstrain-pipe2": ({"pipeline": {"stages": 2, "schedule": "1f1b"}, "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 4}, 0),
    # the same under ZB-H1 (engine/pipe/zb_h1.py); DeepSpeed's peer is its PipelineEngine's 1F1B, as above
    "dstrain-pipe2-zb-h1": ({"pipeline": {"stages": 2, "schedule": "zb_h1"}, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 4}, 0),
    "dstrain-tp2": ({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1, **_ZERO},
                     "gradient_accumulation_steps": 2}, 1),
    # sample_configs/zero3_nvme.json's tiers: the optimizer and the parameters on NVMe (ZeRO-Infinity)
    "dstrain-z3-offload-nvme": ({"zero_optimization": {"stage": 3, **_ZERO, "sub_group_size": 1e6, "offload_optimizer": {
        "device": "nvme", "nvme_path": "NVME_DIR", "buffer_count": 9, "pipeline_read": True, "pipeline_write": True},
        "offload_param": {"device": "nvme", "nvme_path": "NVME_DIR", "buffer_count": 5, "buffer_size": 1e7,
                          "max_in_cpu": 1e7}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 2}}, 3),
    "dstrain-pipe2-tp2": ({"pipeline": {"stages": 2, "schedule": "1f1b"}, "tensor_parallel": {"autotp_size": 2},
                           "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 0),
    # ZeRO-3 under model parallelism: on 2 ranks the data axis has one rank (stage 3's hooks and gathers
    # without their memory saving); pipe 2 x data 2 on 4 ranks partitions each stage over 2 ranks.
    "dstrain-tp2-z3": ({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3, **_ZERO},
                        "gradient_accumulation_steps": 2}, 3),
    "dstrain-pipe2-z3": ({"pipeline": {"stages": 2, "schedule": "1f1b"}, "zero_optimization": {"stage": 3, **_ZERO},
                          "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 3),
    "dstrain-pipe2-dp2-z3": ({"pipeline": {"stages": 2, "schedule": "1f1b"}, "zero_optimization": {"stage": 3, **_ZERO},
                              "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3),
    # sample_configs/zero3_offload.json's tiers (in fp32 here): optimizer and parameters in host memory
    "dstrain-z3-offload-cpu": ({"zero_optimization": {"stage": 3, **_ZERO, "offload_optimizer": {"device": "cpu"},
                                                      "offload_param": {"device": "cpu"}}}, 3),
    # sample_configs/bf16.json's and fp16.json's precision at their stages (fp32 master weights)
    "dstrain-z2-bf16": ({"zero_optimization": {"stage": 2, **_ZERO}, "bf16": {"enabled": True}}, 2),
    "dstrain-z1-fp16": ({"zero_optimization": {"stage": 1, **_ZERO}, "fp16": {"enabled": True,
                                                                              "initial_scale_power": 12}}, 1),
    "dstrain-1bit-lamb": ({"optimizer": {"type": "OneBitLamb", "params": {"lr": bt.LR, "freeze_step": 2}}}, 0),
}
# Strategies on another world size than --world (the label says so): pipe 2 x model 2 and pipe 2 x data 2
# need 4 ranks.
STRATEGY_WORLD = {"dstrain-pipe2-tp2": 4, "dstrain-pipe2-dp2-z3": 4}
# Strategies DeepSpeed has no counterpart for (it ignores unknown top-level keys: it would run plain Adam).
NO_DEEPSPEED = {"dstrain-powersgd": "DeepSpeed has no PowerSGD",
                "dstrain-pipe2-tp2": "no same-model peer: DeepSpeed's PipelineEngine takes tensor parallelism from "
                                     "a Megatron-style mpu (layers written tensor-parallel); PipelineModule with "
                                     "AutoTP (tensor_parallel.autotp_size) is not a documented DeepSpeed path"}
# Strategies DeepSpeed runs, but not as the same thing: said next to the table.
_AUTOTP_CAVEAT = ("DeepSpeed's AutoTP has no policy for this GPT, so its config adds tensor_parallel.partition_config "
                  "naming the projections dstrain's AutoTP shards (benchmarks/deepspeed_gpt_autotp.py, whose check "
                  "compares DeepSpeed's AutoTP losses with the dense GPT's)")
DEEPSPEED_CAVEATS = {"dstrain-tp2": _AUTOTP_CAVEAT, "dstrain-tp2-z3": _AUTOTP_CAVEAT,
                     "dstrain-z2-offload-nvme": "DeepSpeed 0.19.8's ZeRO-2 takes offload_optimizer.device \"nvme\" "
                     "as CPU offload (stage_1_and_2.py: any device but none sets cpu_offload; only ZeRO-3 swaps to "
                     "NVMe), so its row is CPU offload"}
# DeepSpeed failures that are DeepSpeed's own behaviour on the same config and show only for some models or
# machines, so the row still runs and its cell says why when one appears: {strategy: [(a text of DeepSpeed's
# error, why)]}. ZeRO-Infinity on the 25M GPT (2 ranks): parameter partitions of at least the aio block
# (1 MiB) past max_in_cpu's 1e7 elements per rank stay on NVMe (blocks 4-5's qkv, fc, out: 6 of them); the
# 0.7M GPT has none, so it never reads a parameter from NVMe. Reproduced with deepspeed_peer.py alone and
# after the rows before it in the batch (no state carried between engines).
DEEPSPEED_KNOWN_ERRORS = {"dstrain-z3-offload-nvme": [
    # partition_parameters.py Init._set_dtype: `dtype or float16 if fp16 supported else bfloat16` parses as
    # `(dtype or float16) if ... else bfloat16`, and the engine passes the model's fp32 as dtype; first step.
    ("expected m1 and m2 to have the same dtype",
     "DeepSpeed 0.19.8's zero.Init, given an fp32 model on a CPU without mkldnn fp16, makes its NVMe parameter "
     "swap buffers bf16 (Init._set_dtype), so parameters read back from NVMe are bf16 in an fp32 forward"),
    # partitioned_param_swapper.py swap_in; from the second step (trace complete) its prefetch fills the buffers
    ("Not enough buffers",
     "DeepSpeed 0.19.8's NVMe parameter swapper holds each partition it reads in one of offload_param.buffer_count "
     "(5) buffers until the parameter is released, which stage3_max_reuse_distance (1e9) defers past its backward; "
     "more partitions than that are on NVMe"),
    # pipelined_optimizer_swapper.py: in flight at once are the next sub-group (read-ahead), this one and the
    # last one (write-behind), each with its 3 Adam tensors and the gradient
    ("ran out of swap buffers",
     "DeepSpeed 0.19.8's pipelined optimizer swapper takes 4 buffers per sub-group (3 Adam tensors and the "
     "gradient) for 3 sub-groups at once with pipeline_read and pipeline_write: 12 > offload_optimizer.buffer_count 9"),
]}
# Peers without the strategy's kind of parallelism: their ratio column says so instead of a figure.
NO_TORCH_EQUIVALENT = {"dstrain-pipe2": "pipeline stages", "dstrain-pipe2-zb-h1": "pipeline stages",
                       "dstrain-tp2": "tensor parallelism",
                       "dstrain-pipe2-tp2": "pipeline stages x tensor parallelism",
                       "dstrain-tp2-z3": "tensor parallelism", "dstrain-pipe2-z3": "pipeline stages",
                       "dstrain-pipe2-dp2-z3": "pipeline stages"}
TORCH_PEERS = {"ddp": 0, "fsdp2": 3}  # name -> the stage whose memory formula it follows
