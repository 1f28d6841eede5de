"""Every constant of the LSTMem paper, in one place, named as in the paper.

Section and appendix numbers refer to ``lstmem_paper.tex``.
"""

# State configuration (App. C.1, main Qwen3-4B setting).
NUM_HEADS = 4  # n_h, memory heads per layer
HEAD_DIM = 8  # r, head width; d_s = n_h * r
ALPHA = 16.0  # alpha, scale of the attention corrections: (alpha / r) W_dq u
NORM_EPS = 1e-6  # lower bound on the l2-norm denominator of n(.) (App. C.1)

# Block-end feedback (Sec. 3.3, App. C.4).
FEEDBACK_POSITIONS = 32  # |I_b| <= 32 shared, evenly spaced valid positions per block
ETA = 0.01  # eta, feedback step size
EPSILON = 1e-12  # epsilon, heads whose RMS(G) is below it are inactive
RHO = 0.05  # rho, bound on the relative RMS of the cell correction
ACCEPT_TOLERANCE = 1e-7  # slack in the acceptance rule RMS(dC) / s <= rho + 1e-7

# History processing (App. B, C.4).
BLOCK_SIZE = 2048  # tokens per history block

# Evaluation decoding and answer limits (App. B; MemoryAgentBench's per-source limits live in its
# source table, lstmem_peft/eval/mab.py).
EVAL_TEMPERATURE = 0.4
EVAL_TOP_P = 0.9
EVAL_TOP_K = 10
EVAL_SEED = 42
LOCOMO_MAX_NEW_TOKENS = 50
HOTPOTQA_MAX_NEW_TOKENS = 32

# Initialisation (App. C.4 "Initialization").
GATE_BIAS = {"i": -1.0, "f": 2.0, "o": 0.0, "g": -1.0}  # b_gate blocks, in this order
CORRECTION_INIT_COLUMNS = 8  # W_dq, W_do start from the first 8 backbone columns ...
CORRECTION_INIT_SCALE = 0.05  # ... each l2-normalised and scaled by 0.05, the rest zero

# Training (App. C.4 "Episode and objective", "Training schedule").
ANSWER_READ_LIMIT = 512  # read-sequence limit of the answer pass
CONTEXT_DROPOUT = 0.2  # context-dropout probability of the answer pass
STAGE1_HISTORY_CAP = 8192  # QASPER histories, gradients through writing and feedback
STAGE2_HISTORY_CAP = 131072  # Long-dataset histories, written without gradients

PAPER_TITLE = "LSTMem: Hierarchical Long Short-Term Online Memory for Large Language Models"
PAPER_AUTHORS = "Shi, Yang, Zhao, Yin, Bian, Yi, Chen"
PAPER_BIBTEX = """@inproceedings{shi2027lstmem,
  title  = {LSTMem: Hierarchical Long Short-Term Online Memory for Large Language Models},
  author = {Shi, Xianglong and Yang, Ruijie and Zhao, Sirui and Yin, Shukang and Bian, Zihao and
            Yi, Tinghao and Chen, Enhong},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year   = {2027}
}"""
