"""Shared defaults for every config. Each config file calls get_config() here and states only its differences.

Defaults follow the SAGE reference implementation (the paper's trainer, as summarised in the project's shared paper
notes): beta 0.05, k3 anchor with log q on the reference, lr 5e-6 constant, weight decay 0.01, clip 0.2, 8 rollouts
per prompt, temperature 1.0, min_p 0.01, GRPO aggregation (token mean within a sequence, then mean over sequences),
group advantages divided by the group's std with ddof 1 plus 1e-4, 1000 steps.
"""

import ml_collections

from sage_jax.models import sharding
from sage_jax.rl import objectives
from sage_jax.data import templates

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.seed = 0

    # Model: an HF directory (path), else a random-init preset with optional size overrides (0 = keep the preset's).
    c.model = ml_collections.ConfigDict(dict(
        path="", preset="", vocab_size=0, hidden_size=0, num_layers=0, num_heads=0, num_kv_heads=0,
        intermediate_size=0, param_dtype="float32", compute_dtype="bfloat16", remat=False, scan_layers=True,
        logits_chunk=512, ref_dtype="bfloat16",
        # training / no-grad attention: auto | naive | blockwise | cudnn | splash (sage_jax/models/attention.py)
        attention="auto"))
    # LoRA (rank 0 = full fine-tuning): only the adapters train; the frozen base is also the reference policy.
    # targets are HF module names (PEFT's target_modules); init_from is a PEFT adapter directory to continue from.
    c.model.lora = ml_collections.ConfigDict(dict(
        rank=0, alpha=16.0, dropout=0.0, init_from="",
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    c.tokenizer_path = ""  # defaults to model.path

    # rollout_devices = n > 0 (with train.off_policy_steps >= 1): the sampler on a sub-mesh of the last n devices,
    # training on the rest (shape = the training mesh's), the new weights copied over after each update
    c.mesh = ml_collections.ConfigDict(dict(shape=(1, -1, 1), rollout_devices=0))
    c.mesh.rules = ml_collections.ConfigDict({k: v for k, v in sharding.DEFAULT_RULES.items()})

    # Data: task is "math", "kk" or "countdown". train/eval name shared data sets (see sage_jax.data.loaders).
    # template "auto": the model's own chat template (plain text without one) around system_prompt (empty: none, so
    # the template's own default applies) and instruction (the user message; {problem} is the problem). Named
    # templates (sage_jax.data.templates: qwen_math_boxed, r1_think, plain) ignore system_prompt / instruction.
    c.data = ml_collections.ConfigDict(dict(
        task="math", train="math_train_l3to5", eval="math500", data_dir="", template="auto",
        system_prompt="", instruction=templates.MATH_INSTRUCTION, answer_extraction="strict",
        problem_field="", answer_field="", max_prompt_len=2048, eval_problems=0,
        # countdown / kk generators
        num_train=2000, num_eval=200, num_numbers=3, max_number=15, ood_num_numbers=3, ood_max_number=25,
        kk_people=(3, 4, 5), kk_ood_people=(6, 7)))

    c.rollout = ml_collections.ConfigDict(dict(
        prompts_per_step=64, group_size=8, temperature=1.0, top_p=1.0, top_k=0, min_p=0.01, max_new_tokens=6144,
        # decode slots (sage_jax.sampling.sampler): None = one per row (a static batch); N = N rows decode at once, the rest
        # queue for a slot; "auto" = as many as fit the accelerator's free memory
        slots=None,
        # the decode attention (sage_jax.models.decode_forms): "auto" = the platform's (XLA:CPU blocked reads; TPU and
        # GPU a Pallas kernel that reads each row's live positions), or force "blocked", "one_pass" or "kernel"
        decode_attention="auto",
        # partial rollouts (sage_jax/training/partial.py): the sampler returns once the step's groups are complete and
        # the rows still running carry into the next step's call; oversample x prompts_per_step groups are kept in
        # flight; a group whose first token is more than max_lag policy versions older than the step that would train
        # it is dropped (rl/dropped_groups)
        partial=False, oversample=1.5, max_lag=4,
        # tool-integrated rollouts (sage_jax/training/tool_rollouts.py): tools=("python",) or ("calculator",); a row
        # pauses at its call (tool_format "markdown": a closed ```python block; "hermes": the chat template's
        # <tool_call>), the call runs in tool_workers threads (Python in a sandbox, tool_timeout seconds) while the
        # other rows decode, and the row resumes with the output (cut to max_tool_tokens) as untrained tokens; at most
        # max_turns calls per row; max_new_tokens counts the output tokens too. tool_return_share: a sampler call
        # returns (its rows at a call go to the tools, the others carry on in the next call) once this share of its
        # groups is complete; 1.0 (when every row has stopped) measured 0.65x the tool-free tokens/s on CPU against
        # 0.51x at 0.25, whose extra calls re-prefill the carried rows (docs/PERFORMANCE.md, "Tools")
        tools=(), tool_format="markdown", max_turns=4, tool_timeout=5.0, max_tool_tokens=512, tool_workers=8,
        tool_return_share=1.0))

    # The loss and guide defaults live in objectives.LossConfig and guides.GuideConfig (one flat dict here): k3
    # anchor, beta 0.05, clip 0.2, GRPO aggregation, advantages over the group's std (ddof 1) + 1e-4, no guide;
    # Branch gamma 0.3, tau 1.2, every guide clamped to [0.6, 1.4]; the peers' options (entropy bonus, TRL's
    # top-entropy mask, verl's KL-Cov) off.
    c.loss = ml_collections.ConfigDict(objectives.loss_defaults())

    c.optim = ml_collections.ConfigDict(dict(
        lr=5e-6, schedule="constant", warmup_steps=0, weight_decay=0.01, grad_clip=1.0, b1=0.9, b2=0.999,
        eps=1e-8, num_iterations=1, mini_batches=1, grad_accum=1))

    c.train = ml_collections.ConfigDict(dict(
        steps=1000, ckpt_every=50, keep_ckpts=3, eval_every=100, sample_every=10, export_hf=True,
        reward="math", reward_workers=8, reward_timeout=10.0, logprob_rows=64,
        packing=True,  # reference / old-policy passes and updates on packed rows (sage_jax/rl/packing.py)
        dynamic_sampling=False, max_resample=3, overlong_buffer=0, overlong_penalty=1.0,
        use_tensorboard=True, use_wandb=False, progress=True,
        # k > 0: step t trains on rollouts sampled by the policy of step t - k; batch t + k is generated (and scored
        # on the host) while step t trains (sage_jax/training/offpolicy.py). 0: on-policy, strictly serial
        off_policy_steps=0))

    c.eval = ml_collections.ConfigDict(dict(
        n=16, ks=(1, 4, 16), problems=0, temperature=1.0, top_p=1.0, min_p=0.0, max_new_tokens=0,
        at_start=True, at_end=True))

    # Supervised warm-start before RL (0 steps = none). data: "countdown" demos or a jsonl with prompt/completion.
    c.sft = ml_collections.ConfigDict(dict(
        steps=0, lr=1e-3, warmup_steps=20, batch_size=64, data="countdown", prompt_field="prompt",
        completion_field="completion", mode_weights=ml_collections.ConfigDict(
            dict(mul=0.7, add=0.2, sub=0.07, div=0.03)), num_demos=4000))
    c.train.reward_memory_mb = 4096  # address-space cap per reward worker (0 = none)
    c.sft.ckpt_every = 100  # SFT checkpoint period in steps; a rerun resumes from the newest
    c.sft.tool_share = 0.0  # sft.data="tool_traces": the share of demonstrations that call the Python tool
    # a resume whose config differs from the checkpoint's (outside run_record.MAY_CHANGE) stops, unless this is set:
    # then the change is recorded in WORKDIR/config_changes.json
    c.train.allow_config_change = False
    return c


def parse_arm(arg: str | None, arms, kind: str, choices, default: str) -> tuple[str, str]:
    """An arm file's argument "ARM" or "ARM,OPTION" -> (arm, option): arm one of `arms` (default grpo), option one of
    `choices` (its `kind`, e.g. preset; default `default`); anything else is an error naming the choices."""
    arm, _, option = (arg or "grpo").partition(",")
    arm, option = arm or "grpo", option or default
    if arm not in arms:
        raise ValueError(f"unknown arm {arm!r}: choose one of {', '.join(arms)} (optionally ',{kind}': "
                         f"{', '.join(choices)})")
    if option not in choices:
        raise ValueError(f"unknown {kind} {option!r} in {arg!r}: choose one of {', '.join(choices)}")
    return arm, option


def set_fields(c: ml_collections.ConfigDict, dotted: dict, where: str) -> None:
    """c[a][b] = value for each "a.b": value; a key that names no field is an error naming `where` (an arm file)."""
    for key, value in dotted.items():
        *path, leaf = key.split(".")
        node = c
        for part in path:
            node = node[part]
        if leaf not in node:
            raise ValueError(f"{where}: {key!r} is not a config field")
        node[leaf] = value
