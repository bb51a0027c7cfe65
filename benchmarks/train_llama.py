"""jzo training a shape of a Hugging Face family (Llama 2/3, Mistral, Qwen,
Phi, Qwen3-MoE, Mixtral, Gemma): a preset of jzo.models.llama or
jzo.models.gemma from random weights, or a Hugging Face folder's weights,
measured as benchmarks/train_gpt.py measures a GPT (the same configurations,
flags and record; see its --help).

Model TFLOPS count the config's flops_per_token: 6 N + 12 L (H head_dim) T a
token (N every parameter, a mixture of experts' active ones; T the sequence
length; recomputation not counted). benchmarks/peers_hf.py trains
transformers' model of the same shape under DeepSpeed or PyTorch.

  python3 benchmarks/train_llama.py --model llama-3.1-8b --seq-len 4096 --batch 4 \\
      --configs auto_dpu --steps 8 --json llama8b.json
  python3 benchmarks/train_llama.py --model qwen2.5-14b --moments bf16 --batch 1 2 \\
      --configs auto --steps 5
  python3 benchmarks/train_llama.py --model ~/models/Llama-3.2-1B --seq-len 2048 --batch 4
  python3 benchmarks/train_llama.py --model gemma-2-9b --stage 3 --grads-in-params \
      --moments int8 --seq-len 4096 --batch 2 --configs auto --steps 5
  python3 benchmarks/train_llama.py --model llama-tiny --seq-len 32 --batch 2 --steps 1  # CPU
"""

import engine_runs

if __name__ == "__main__":
  engine_runs.main(__doc__, engine_runs.LLAMA, "train_llama")
