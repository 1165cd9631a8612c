"""A screen for configs/reasoning.toml's settings: a single-process replica of decentrl's GRPO step
for one-token answers (staleness 1, TIS cap 2, PPO clip, entropy bonus, AdamW, grad clip 1) on
reasoning-gym's simple_equations, far cheaper than `decentrl run`, so settings can be compared over
seeds before the real system runs them (docs/tasks.md quotes its figures; the real runs decide).
Held-out reward is the exact expected pass@1 (the probability of the right digit token). Prints one
JSON object per evaluation; the last line is the final one.

    PYTHONPATH=. python benchmarks/reasoning_screen.py --model models/equation-digits --lr 1e-3 --steps 600 --seed 0
"""
import argparse
import copy
import json
import random
import time

import reasoning_gym
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--model", default="models/equation-digits")
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--ent", type=float, default=0.05)
p.add_argument("--group", type=int, default=16)
p.add_argument("--groups", type=int, default=32)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--stale", type=int, default=1)
p.add_argument("--hidden", type=int, default=0)
p.add_argument("--layers", type=int, default=0)
p.add_argument("--inter", type=int, default=0)
p.add_argument("--ent_end", type=float, default=None)
p.add_argument("--size", type=int, default=1000)
p.add_argument("--sft", action="store_true")
p.add_argument("--eval_every", type=int, default=50)
a = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(a.seed)
random.seed(a.seed)
tok = AutoTokenizer.from_pretrained(a.model)
opts = dict(min_terms=2, max_terms=2, min_value=1, max_value=9, operators=["+"], operators_weights=[1.0])
train = list(reasoning_gym.create_dataset("simple_equations", size=a.size, seed=0, **opts))
trained = {x["question"] for x in train}
held = [
    x for x in reasoning_gym.create_dataset("simple_equations", size=a.size + 2000, seed=12345, **opts) if x["question"] not in trained
][:256]


def enc(xs):
    ids = [tok.apply_chat_template([{"role": "user", "content": x["question"]}], tokenize=True, add_generation_prompt=True) for x in xs]
    ids = [i["input_ids"] if isinstance(i, dict) or hasattr(i, "keys") else i for i in ids]
    return ids
V = len(tok)
decoded = [tok.decode([t]).strip(" \t\n") for t in range(V)]
def right_mask(xs):
    m = torch.zeros(len(xs), V)
    for i, x in enumerate(xs):
        for t in range(V):
            if decoded[t] == x["answer"]:
                m[i, t] = 1
    return m
train_ids = enc(train)
held_ids = enc(held)
train_right = right_mask(train)
held_right = right_mask(held)
if a.hidden:
    cfg = Qwen2ForCausalLM.from_pretrained(a.model).config
    cfg.hidden_size = a.hidden
    cfg.num_hidden_layers = a.layers or cfg.num_hidden_layers
    cfg.intermediate_size = a.inter or 2 * a.hidden
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(cfg)
elif a.layers:
    cfg = Qwen2ForCausalLM.from_pretrained(a.model).config
    cfg.num_hidden_layers = a.layers
    cfg.layer_types = ["full_attention"] * a.layers
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(cfg)
else:
    model = Qwen2ForCausalLM.from_pretrained(a.model)
model.train()
def last_logits(m, ids):
    L = max(len(i) for i in ids)
    x = torch.zeros(len(ids), L, dtype=torch.long)
    att = torch.zeros(len(ids), L, dtype=torch.long)
    for r, i in enumerate(ids):
        x[r, :len(i)] = torch.tensor(i)
        att[r, :len(i)] = 1
    out = m(input_ids=x, attention_mask=att).logits
    last = torch.tensor([len(i) - 1 for i in ids])
    return out[torch.arange(len(ids)), last]
def evaluate(m):
    with torch.no_grad():
        pr = torch.softmax(last_logits(m, held_ids), -1)
    per = (pr * held_right).sum(-1)
    return per.mean().item(), (per.std() / len(per) ** 0.5).item()
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
history = [copy.deepcopy(model.state_dict())]
sampler = Qwen2ForCausalLM(model.config)
sampler.eval()
t0 = time.time()
log = []
for step in range(1, a.steps + 1):
    ent = a.ent if a.ent_end is None else a.ent + (a.ent_end - a.ent) * (step - 1) / (a.steps - 1)
    sampler.load_state_dict(history[0])
    idx = [random.randrange(len(train)) for _ in range(a.groups)]
    ids = [train_ids[i] for i in idx]
    with torch.no_grad():
        sp = torch.log_softmax(last_logits(sampler, ids), -1)
    toks = torch.multinomial(sp.exp(), a.group, replacement=True)  # (G, n)
    rew = train_right[idx].gather(1, toks)  # (G, n)
    adv = (rew - rew.mean(1, keepdim=True)) / (rew.std(1, unbiased=False, keepdim=True) + 1e-6)
    lp_all = torch.log_softmax(last_logits(model, ids), -1)
    lp = lp_all.gather(1, toks)
    slp = sp.gather(1, toks)
    lr_ = (lp.detach() - slp)
    ratio = lr_.exp()
    w = ratio.clamp(max=2.0)
    clipped = ((adv > 0) & (ratio > 1.28)) | ((adv < 0) & (ratio < 0.8))
    H = -(lp_all.exp() * lp_all).sum(-1, keepdim=True).expand_as(lp)
    loss = (-(w * (~clipped)) * adv * lp - ent * H).mean()
    if a.sft:
        loss = -(lp_all * train_right[idx]).sum(-1).mean()
    opt.zero_grad()
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    history.append(copy.deepcopy(model.state_dict()))
    history = history[-(a.stale + 1):] if a.stale else history[-1:]
    log.append(rew.mean().item())
    if step % a.eval_every == 0 or step == a.steps:
        m, s = evaluate(model)
        print(
            json.dumps(
                {
                    "step": step,
                    "train": round(sum(log[-10:]) / 10, 3),
                    "held": round(m, 3),
                    "se": round(s, 3),
                    "H": round(H.mean().item(), 2),
                    "t": round(time.time() - t0),
                }
            ),
            flush=True,
        )
