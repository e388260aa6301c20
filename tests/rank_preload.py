"""Imported once by tests/harness.py's forkserver in a pytest session (not for the benchmarks that start
ranks through the harness), so that its ranks find these modules loaded: what a fifth of the suite's
ranks import. Found from the repository root, where the suite runs (elsewhere nothing is preloaded).

transformers' model machinery (the package, `modeling_utils`, GPT-2's and Llama's modelling), 2.1 s of
CPU per rank at load 3.4, imported by every rank of the Hugging Face tests (AutoTP families,
zero.Init of HF models, activation checkpointing of HF blocks, ...: a dozen test files, most ranks 2 per world). Its import
adds a warnings filter (an `ignore` for torch.optim.lr_scheduler's UserWarnings); it is taken back here,
so a rank that never imports transformers sees the warnings filters it saw before this preload. Nothing
imported starts a thread or runs a torch op (checked: one thread after it). Without transformers installed
there is nothing to preload."""
import warnings

with warnings.catch_warnings():
    try:
        import transformers  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
    except ImportError:
        pass
