"""The workloads every system runs: deterministic request lists, the same token ids for everyone."""
from __future__ import annotations

import random
from dataclasses import dataclass

from enginelib.bench.quality import shakespeare
from enginelib.config import SamplingParams
from enginelib.model.tokenizer import Tokenizer

WORKLOADS = ("seed", "mixed", "poisson", "shared-prefix", "long-prompt")

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three colors.", "Tell me a story about a dragon.", "What is 12 times 7?", "Name a fruit.",
    "How do airplanes fly?", "Give me a recipe for pancakes.", "What is photosynthesis?",
    "Describe a sunset.", "Why do cats purr?", "What is a black hole?", "Write a limerick about a cat.",
    "How does a computer work?", "What causes rain?", "Explain what DNA is.", "What is the speed of light?",
    "Suggest a name for a dog.", "Why is the sky blue?", "What is an atom?", "How do vaccines work?",
    "What is the tallest mountain?", "Write a short poem about autumn.", "What are prime numbers?",
    "How do bees make honey?", "What is inflation?", "Describe the water cycle.", "Who wrote Hamlet?",
    "What is machine learning?", "How do magnets work?", "What is a volcano?", "Explain recursion.",
    "What do pandas eat?", "How far is the Moon?", "What is the internet?",
]


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0   # seconds after the start (Poisson arrivals)
    arrival_step: int = 0    # engine steps after the start (requests injected mid-decode)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    ignore_eos: bool = True

    def params(self, request: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=request.max_tokens, ignore_eos=self.ignore_eos)


def chat_prompt(tok: Tokenizer, question: str, system: str | None = None) -> list[int]:
    """The token ids of a one-question chat (and an optional system prompt): every system gets the same ids."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return tok.encode(tok.apply_chat_template(messages))


def make_workload(name: str, tok: Tokenizer, quick: bool = False, rate: float = 2.0,
                  long_tokens: int | None = None) -> Workload:
    """The named workload, deterministic (seeded); ``quick`` shrinks it to fit a 2-core CPU in minutes.

    ``long_tokens``: the length of the ``long-prompt`` workload's documents (default 700 quick, 1,500 full:
    sized for a CPU; :func:`enginelib.bench.scheduling.long_prompt_tokens` scales them to a GPU)."""
    rng = random.Random(0)
    if name == "seed":  # the seed project's benchmark: 28 prompts, 6 more after the 5th step, 128 tokens
        first, later, new = (12, 4, 32) if quick else (28, 6, 128)
        reqs = [BenchRequest(chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]), new, arrival_step=0 if i < first else 5)
                for i in range(first + later)]
        return Workload(name, reqs)
    if name == "mixed":  # long-tailed prompt and output lengths
        n, cap = (12, 64) if quick else (32, 256)
        reqs = []
        for i in range(n):
            words = min(300, int(rng.lognormvariate(3.0, 1.0)))
            question = QUESTIONS[i % len(QUESTIONS)] + " " + " ".join(rng.choice(QUESTIONS).split()[:1] * words)
            reqs.append(BenchRequest(chat_prompt(tok, question), max(4, min(cap, int(rng.lognormvariate(3.5, 0.8))))))
        return Workload(name, reqs)
    if name == "poisson":  # arrivals at `rate` requests per second
        n, new = (12, 24) if quick else (32, 64)
        t, reqs = 0.0, []
        for i in range(n):
            t += rng.expovariate(rate)
            reqs.append(BenchRequest(chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]), new, arrival_s=t))
        return Workload(name, reqs)
    if name == "shared-prefix":  # many requests behind one long system prompt
        n, new = (12, 24) if quick else (32, 64)
        system = ("You are a meticulous assistant for a bakery. Answer briefly and kindly. " * 12).strip()
        reqs = [BenchRequest(chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)], system), new) for i in range(n)]
        return Workload(name, reqs)
    if name == "long-prompt":  # short requests decoding when long documents arrive (chunked prefill, chapter 10)
        short, new, default_long, at = (6, 40, 700, (6, 18)) if quick else (12, 96, 1500, (8, 30, 60))
        long_tokens = long_tokens or default_long
        reqs = [BenchRequest(chat_prompt(tok, QUESTIONS[i % len(QUESTIONS)]), new) for i in range(short)]
        words = " ".join(QUESTIONS).split()
        for i, step in enumerate(at):
            document = " ".join(words[(i * 7 + j) % len(words)] for j in range(long_tokens))
            ids = chat_prompt(tok, "Summarize this text: " + document)[-long_tokens:]
            reqs.append(BenchRequest(ids, 4, arrival_step=step))
        return Workload(name, reqs)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def extractive_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    """Chats that ask the model to copy a passage of the shipped Shakespeare: what prompt lookup is made for."""
    lines = [line.strip() for line in shakespeare().splitlines() if len(line.split()) >= 4]
    return [chat_prompt(tok, "Repeat this passage exactly, word for word:\n\n" + "\n".join(lines[6 * i:6 * i + 6]))
            for i in range(n)]
