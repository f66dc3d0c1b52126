"""Training PEFT adapters that carry reward tokens: what the pipeline adds to `rcgrpo.tokens` (which adds
the tokens and makes their rows PEFT trainable tokens) for its SFT / RCTP and RL runs.

- `token_lr_groups` / `scale_row_updates`: the token rows' own learning rate (`token_lr_multiplier`).
- `small_adapter_saves`: adapters without PEFT's copy of the resized embedding matrices (the trained rows
  are in the adapter as trainable tokens).
- `compact_head_loss`: the CPU loss path;
  `lora_targets`: PEFT's `target_modules` of a module list.
The adapter as an MLflow model: `model_registry`. Heavy imports (torch, peft) happen inside the functions.
"""

from __future__ import annotations

import contextlib
import functools

from rcgrpo_tasks.engine.shared_prefix import target_hidden, trunk_and_head


def lora_targets(modules: tuple[str, ...]) -> str | list[str]:
    """PEFT `target_modules`: the module names, or PEFT's "all-linear" for `("all-linear",)`."""
    return "all-linear" if tuple(modules) == ("all-linear",) else list(modules)



def trainable_token_params(model) -> list:
    """The PEFT trainable-token rows of `model` (`trainable_tokens_delta` parameters that require grad;
    with tied embeddings the head shares the input's, listed once)."""
    seen, out = set(), []
    for name, param in model.named_parameters():
        if "trainable_tokens_delta" in name and param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def token_lr_groups(optimizer, params: list, multiplier: float) -> None:
    """Move `params` out of the optimizer's groups into groups of their own with `lr` x `multiplier` (each
    keeps the rest of its former group's settings, e.g. weight decay). Call it on a fresh optimizer, before
    the learning-rate scheduler is built: the scheduler then scales every group's own initial lr."""
    wanted = {id(p) for p in params}
    extra = []
    for group in optimizer.param_groups:
        moved = [p for p in group["params"] if id(p) in wanted]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in wanted]
            extra.append({**{k: v for k, v in group.items() if k != "params"}, "params": moved,
                          "lr": group["lr"] * multiplier, "rcgrpo_token_rows": True})
    for group in extra:
        optimizer.add_param_group(group)


def scale_row_updates(optimizer, weights: list, rows: list[int], multiplier: float) -> None:
    """Full fine-tuning: make every optimizer step move `rows` of each matrix in `weights` `multiplier`
    times as far (the token rows live inside the embedding matrix, so they cannot have a group of their own).

    Why the step and not the gradient: Adam normalises the gradient, so scaling it barely changes the
    update. The step of AdamW (and Adam, SGD) on a row is lr x (direction from optimizer state + decoupled
    decay), and the optimizer state does not depend on lr, so multiplying each step's change of the rows
    by k is exactly training those rows at k x lr. Hooks on the optimizer: the rows are saved before each
    step and their change is scaled after it (a step skipped by the fp16 scaler runs neither)."""
    import torch

    saved: list = []
    index = torch.tensor(rows, dtype=torch.long)

    def before(opt, args, kwargs):
        saved[:] = [w.detach()[index.to(w.device)].clone() for w in weights]

    def after(opt, args, kwargs):
        with torch.no_grad():
            for w, old in zip(weights, saved):
                i = index.to(w.device)
                w[i] = old + multiplier * (w[i] - old)
        saved.clear()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def compact_head_loss(trainer, model, inputs: dict, num_items_in_batch=None, objective=None):
    """Token-mean NLL projecting only the labelled (assistant) positions through the LM head.

    TRL's fused head scores every position on devices without Triton; assistant tokens are a small share
    of these chats (long system prompts and tool outputs), so this skips most of the 49k-wide head work.
    Same loss and the same logged metrics (entropy, token accuracy, token count) as TRL's path. A
    micro-batch's shared tokens (an RCTP pair's prompt) go through the trunk once (`shared_prefix`, at the
    trainer's `shared_prefix` threshold). `objective(logp, targets, mask, inputs) -> (weights, extra)`, when
    given, reweights each labelled token's NLL (`weights`, one per labelled position, or None) and adds `extra`
    (a summed loss term) before the division by the token count: the RCTP objective's hook
    (`train.sft.objective`).
    """
    import torch

    trunk, head = trunk_and_head(trainer.accelerator.unwrap_model(model))
    labels = inputs["labels"]
    targets = torch.zeros_like(labels, dtype=torch.bool)
    targets[:, 1:] = labels[:, 1:] != -100  # token t's label, predicted at t - 1
    mask = targets[:, 1:]
    with trainer.accelerator.autocast():
        if "position_ids" in inputs or "attention_mask" not in inputs:  # padding-free: TRL's packed rows
            kwargs = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
            hidden = trunk(**kwargs, use_cache=False).last_hidden_state[:, :-1][mask]
        else:
            hidden = target_hidden(trunk, inputs["input_ids"], inputs["attention_mask"], targets,
                                   getattr(trainer, "shared_prefix", None), trainer.processing_class.pad_token_id or 0)
        logits = head(hidden)
    logp = torch.log_softmax(logits.float(), dim=-1)
    tgt = labels[:, 1:][mask]
    nll = -logp.gather(-1, tgt[:, None]).squeeze(-1)
    denom = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1)
    weights, extra = objective(logp, tgt, mask, inputs) if objective is not None else (None, 0.0)
    loss = ((nll if weights is None else nll * weights).sum() + extra) / denom
    with torch.no_grad():
        n = max(int(mask.sum()), 1)
        metrics = trainer._metrics["train"]
        metrics["entropy"].append(float(-(logp.exp() * logp).sum() / n))
        metrics["mean_token_accuracy"].append(float((logp.argmax(-1) == tgt).sum() / n))
        seen = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["position_ids"].size(1)
        trainer._total_train_tokens += int(seen)
        metrics["num_tokens"] = [trainer._total_train_tokens]
    return loss


@contextlib.contextmanager
def small_adapter_saves(model, tokenizer=None):
    """Make `model.save_pretrained` (as called by Trainer checkpoints and mlflow) skip PEFT's full copy of
    the resized embedding matrices: the special-token rows are in the adapter already (trainable tokens).
    With `tokenizer`, every save also writes it next to the adapter."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        yield
        return
    original = model.save_pretrained

    @functools.wraps(original)
    def save_pretrained(path, *args, **kwargs):
        original(path, *args, **{**kwargs, "save_embedding_layers": False})
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    model.save_pretrained = save_pretrained
    try:
        yield
    finally:
        del model.save_pretrained
