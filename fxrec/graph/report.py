"""The optimization report: which rule fired where, and why a candidate was left alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Firing", "Refusal", "Report"]


@dataclass
class Firing:
    """One application of a rule: the nodes it replaced and what it produced."""

    rule: str
    family: str
    nodes: list[str]
    detail: str = ""


@dataclass
class Refusal:
    """A candidate a rule saw and did not rewrite, with the reason."""

    rule: str
    nodes: list[str]
    reason: str


@dataclass
class Report:
    """Everything ``fxrec.optimize`` decided, printable and JSON-serialisable."""

    capture: str = ""
    firings: list[Firing] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    kernels_before: tuple[int, int] | None = None  # (forward, backward)
    kernels_after: tuple[int, int] | None = None
    passes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def fired(self, rule: str, family: str, nodes: list[Any], detail: str = "") -> None:
        self.firings.append(
            Firing(rule, family, [getattr(n, "name", str(n)) for n in nodes], detail)
        )

    def __post_init__(self) -> None:
        self._refused: set[tuple[str, tuple[str, ...], str]] = set()

    def refused(self, rule: str, nodes: list[Any], reason: str) -> None:
        """Record a refusal once: the driver's later passes see the same candidate again."""
        names = [getattr(n, "name", str(n)) for n in nodes]
        key = (rule, tuple(names), reason)
        if key not in self._refused:
            self._refused.add(key)
            self.refusals.append(Refusal(rule, names, reason))

    def note(self, text: str) -> None:
        """Add a note once (the same situation on several graphs is one note)."""
        if text not in self.notes:
            self.notes.append(text)

    def mark(self) -> tuple[int, int, int, int]:
        """Where the report stands now; :meth:`undo` forgets what is recorded after it."""
        return len(self.firings), len(self.refusals), self.nodes_before, self.nodes_after

    def undo(self, mark: tuple[int, int, int, int]) -> int:
        """Forget the firings and refusals recorded since ``mark``: their graphs were thrown
        away (a failed check, a failing rule), so the report must not list rewrites that do not
        run. Graphs counted since then keep their nodes. Returns how many firings went."""
        firings, refusals, before, after = mark
        undone = len(self.firings) - firings
        for r in self.refusals[refusals:]:
            self._refused.discard((r.rule, tuple(r.nodes), r.reason))
        del self.firings[firings:], self.refusals[refusals:]
        self.nodes_after = after + (self.nodes_before - before)
        return undone

    def count(self, rule: str | None = None) -> int:
        """How many times ``rule`` (or any rule) fired."""
        return sum(1 for f in self.firings if rule is None or f.rule == rule)

    def merge(self, other: Report) -> None:
        """Fold in the report of another captured graph (graph breaks, train/eval)."""
        self.firings += other.firings
        self.refusals += other.refusals
        self.nodes_before += other.nodes_before
        self.nodes_after += other.nodes_after
        self.passes = max(self.passes, other.passes)
        self.seconds += other.seconds
        for text in other.notes:  # once each, as ``note`` adds them
            self.note(text)

    def for_copy(self) -> Report:
        """The report of a copy (deepcopy, pickle), whose graphs are rebuilt on its first
        calls and report their rules again: what optimize measured, without the graphs."""
        return Report(
            capture=self.capture,
            kernels_before=self.kernels_before,
            kernels_after=self.kernels_after,
            notes=list(self.notes),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __repr__(self) -> str:
        """The summary, as ``print`` gives it: a REPL or notebook shows this, and the dataclass
        fields list every node name (tens of thousands of characters on large models);
        ``to_dict()`` has them all."""
        return str(self)

    def __str__(self) -> str:
        lines = [
            f"fxrec report ({self.capture or 'no capture'}): nodes {self.nodes_before} -> "
            f"{self.nodes_after} in {self.passes} passes, {self.seconds * 1e3:.1f} ms"
        ]
        if self.kernels_before and self.kernels_after:
            (fb, bb), (fa, ba) = self.kernels_before, self.kernels_after
            lines.append(f"  kernels forward {fb} -> {fa}, backward {bb} -> {ba}")
        by_rule = Counter(f.rule for f in self.firings)
        sizes: Counter[str] = Counter()
        where: dict[str, list[str]] = {}
        for f in self.firings:
            sizes[f.rule] += len(f.nodes)
            where.setdefault(f.rule, []).extend(f.nodes[: 3 - len(where.get(f.rule, []))])
        for rule, n in sorted(by_rule.items()):
            names = ", ".join(where[rule]) + (", ..." if sizes[rule] > len(where[rule]) else "")
            lines.append(f"  fired  {rule:<28} x{n:<4} ({sizes[rule]} nodes: {names})")
        reasons = Counter((r.rule, r.reason) for r in self.refusals)
        for (rule, reason), n in sorted(reasons.items()):
            lines.append(f"  left   {rule:<28} x{n:<4} {reason}")
        lines += [f"  note   {n}" for n in self.notes]
        return "\n".join(lines)
