"""Chapter 12: structured output. A regex as a DFA, the tokens each DFA state allows, your engine masking to them."""
import torch

from .engine import MiniEngine

CLASSES = {"d": "0123456789", "s": " \t\n", "w": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"}


class Regex:
    """A regex (literals, ., [a-z], [^"], \\d \\w \\s, other escapes as the character itself, groups, |, *, +, ?) as an
    NFA, Thompson's way. A DFA state is a set of NFA states, made when the text first reaches it; empty: dead."""

    def __init__(self, pattern: str) -> None:
        self.pattern, self.pos, self.moves, self.masks = pattern, 0, {}, {}
        self.edges: list[list[tuple[tuple[str, bool] | None, int]]] = []  # per state: ((chars, negated) | None, to)
        try:
            start, self.accept = self.alternation()
        except IndexError:
            raise ValueError(f"{pattern!r} ends too soon") from None
        if self.pos != len(pattern):
            raise ValueError(f"unbalanced ( or ) in {pattern!r}")
        self.start = self.closure({start})

    def new(self, label=None) -> tuple[int, int]:
        """Two new states, joined by a move that reads a character of ``label`` (no label: not joined)."""
        self.edges += [[(label, len(self.edges) + 1)] if label else [], []]
        return len(self.edges) - 2, len(self.edges) - 1

    def alternation(self) -> tuple[int, int]:
        start, end = self.new()
        while True:
            a, b = self.sequence()
            self.edges[start].append((None, a)), self.edges[b].append((None, end))
            if self.pattern[self.pos:self.pos + 1] != "|":
                return start, end
            self.pos += 1

    def sequence(self) -> tuple[int, int]:
        start = end = self.new()[0]
        while self.pattern[self.pos:self.pos + 1] not in ("", "|", ")"):
            a, b = self.repeat()
            self.edges[end].append((None, a))
            end = b
        return start, end

    def repeat(self) -> tuple[int, int]:
        a, b = self.atom()
        op = self.pattern[self.pos:self.pos + 1]
        if op not in ("*", "+", "?"):
            return a, b
        self.pos += 1
        start, end = self.new()
        self.edges[start].append((None, a)), self.edges[b].append((None, end))
        if op != "+":
            self.edges[start].append((None, end))  # * and ? may skip it
        if op != "?":
            self.edges[b].append((None, a))        # * and + may repeat it
        return start, end

    def atom(self) -> tuple[int, int]:
        c, self.pos = self.pattern[self.pos], self.pos + 1
        if c in "*+?{)|":
            why = "counted repetition is not supported" if c == "{" else "it follows nothing it could repeat"
            raise ValueError(f"{c!r} at {self.pos - 1} in {self.pattern!r}: {why}")
        if c == "(":
            a, b = self.alternation()
            self.pos += 1  # past its ")" (one missing: pos passes the end, and __init__ says so)
            return a, b
        if c == "[":
            negated, chars = self.pattern[self.pos] == "^", ""
            self.pos += negated
            while (c := self.pattern[self.pos]) != "]":
                self.pos += 1
                if self.pattern[self.pos] == "-" and self.pattern[self.pos + 1] != "]":  # a range: a-z
                    c = "".join(map(chr, range(ord(c), ord(self.pattern[self.pos + 1]) + 1)))
                    self.pos += 2
                chars += c
            self.pos += 1
            return self.new((chars, negated))
        if c == "\\":
            c, self.pos = CLASSES.get(self.pattern[self.pos], self.pattern[self.pos]), self.pos + 1
            return self.new((c, False))
        return self.new(("\n", True) if c == "." else (c, False))

    def closure(self, states: set[int]) -> frozenset:
        todo, seen = list(states), set(states)
        while todo:
            for label, t in self.edges[todo.pop()]:
                if label is None and t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def walk(self, state: frozenset, text: str) -> frozenset:
        """The DFA state after reading ``text`` from ``state`` (each move computed once, then remembered)."""
        for c in text:
            if (state, c) not in self.moves:
                self.moves[state, c] = self.closure({t for s in state for label, t in self.edges[s]
                                                     if label and (c in label[0]) != label[1]})
            state = self.moves[state, c]
            if not state:
                break
        return state


class GuidedEngine(MiniEngine):
    """Your engine, with a regex per request: before sampling, its row keeps only the tokens its DFA state allows."""

    def __init__(self, model, eos_token_id: int, token_texts: list[str | None], **kw) -> None:
        super().__init__(model, eos_token_id, **kw)
        self.texts, self.regexes, self.compiled = token_texts, {}, {}  # (special tokens' text: None)

    def add(self, prompt_ids: list[int], max_tokens: int, regex: str | None = None) -> str:
        request_id = super().add(prompt_ids, max_tokens)
        if regex is not None:  # requests with the same regex share it, and the masks it has made
            self.regexes[request_id] = self.compiled.setdefault(regex, Regex(regex))
        return request_id

    def allowed(self, regex: Regex, state: frozenset) -> list[int]:
        """Tokens whose whole text the DFA reads from ``state`` without dying; EOS where the text so far matches."""
        if state not in regex.masks:
            regex.masks[state] = [i for i, text in enumerate(self.texts) if text and regex.walk(state, text)]
            regex.masks[state] += [self.scheduler.eos_token_id] * (regex.accept in state)
        return regex.masks[state]

    def sample(self, plan, logits: torch.Tensor) -> list[int]:
        for row, work in enumerate(plan.scheduled):
            if (regex := self.regexes.get(work.request.request_id)) is not None:
                text = "".join(self.texts[t] or "" for t in work.request.output_token_ids)
                allowed = torch.tensor(self.allowed(regex, regex.walk(regex.start, text)), device=logits.device)
                logits[row] = torch.full_like(logits[row], float("-inf")).index_copy(0, allowed, logits[row, allowed])
        return super().sample(plan, logits)
