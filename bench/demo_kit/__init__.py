"""The kit that builds the built-in demo model: its tokenizer, the synthetic corpus (data, arith, react, corpus),
the training script (`python -m radixserve.bench.demo_kit.train`) and the held-out evaluation (eval_cases). The
weights it writes ship as package data in kernels/demo_checkpoint/, which kernels/demo.py names; nothing at serving
time imports this package."""
