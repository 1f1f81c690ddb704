"""The rendering and checking base of the drills' results.

A result derives ``DrillResult`` and says only what is its own: ``checks()`` (each part of the claim and
whether it holds), ``intro()`` (the setting and the claim), ``body()`` (its tables and notes) and
``verdict()`` (the closing sentence). The base lays them out (``render()``: intro, body, one ``ok`` / ``FAIL``
line per check, then ``PASS`` / ``FAIL`` and the verdict), gives ``passed`` and the plain-text ``summary()``.
Most results hold a setting and one run's figures (``ConfiguredResult``), some a run under a comparison
policy beside it (``ComparedResult``, run by ``main_and_compare``). ``table`` builds the rich tables every
drill shows (``cell_table`` one from its columns' cells); ``fmt_*`` format their cells, ``fleet`` names the
emulated fleet in an intro.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from fairgate.drills import DrillOptions
    from fairgate.harness.history import HistoryReport
    from fairgate.harness.replica import ReplicaModel


class DrillResult(ABC):
    """What every drill returns: ``name``, ``passed``, ``checks()``, ``render()`` and ``summary()``."""

    name: str

    @abstractmethod
    def checks(self) -> dict[str, bool]:
        """Each part of the drill's claim and whether it holds."""

    @abstractmethod
    def intro(self) -> list[str]:
        """The setting and the claim (rich markup)."""

    def body(self) -> list[Any]:
        """Tables and notes between the intro and the checks."""
        return []

    @abstractmethod
    def verdict(self) -> str:
        """The closing sentence, after ``PASS`` / ``FAIL``."""

    @property
    def passed(self) -> bool:
        return all(self.checks().values())

    def check_lines(self) -> list[str]:
        """One line per check, ``ok`` or ``FAIL`` and its claim (rich markup)."""
        checks = self.checks().items()
        return [f"  {'[green]ok[/green]  ' if ok else '[red]FAIL[/red]'} {check}" for check, ok in checks]

    def render(self) -> list[Any]:
        """Tables and lines for a rich console."""
        mark = "[green]PASS[/green]" if self.passed else "[red]FAIL[/red]"
        return [*self.intro(), *self.body(), *self.check_lines(), f"{mark}: {self.verdict()}"]

    def summary(self) -> str:
        """``render()`` as plain text."""
        return plain_text(self.render())


class PolicyRun(Protocol):
    """Figures of one run under one gateway policy."""

    @property
    def policy(self) -> str: ...


ConfigT = TypeVar("ConfigT")
FiguresT = TypeVar("FiguresT")
RunT = TypeVar("RunT", bound=PolicyRun)
K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class ConfiguredResult(DrillResult, Generic[ConfigT, FiguresT]):
    """A drill's setting (``config``) and the figures of its run under the policy tested (``main``)."""

    config: ConfigT
    main: FiguresT

    # The setting and the claim: a ``str.format`` template over ``intro_fields()``, a paragraph (lines apart
    # by a blank one) a line of the intro. A drill whose intro is not a template overrides ``intro()``.
    INTRO: ClassVar[str] = ""

    def intro_fields(self) -> dict[str, Any]:
        """The names ``INTRO`` may use: ``c`` (the config) and ``main`` (the figures of the run)."""
        return {"c": self.config, "main": self.main}

    def intro(self) -> list[str]:
        if not self.INTRO:
            raise NotImplementedError(f"{type(self).__name__}: give it an INTRO or an intro()")
        text = self.INTRO.format(**self.intro_fields())
        return [" ".join(paragraph.split()) for paragraph in text.split("\n\n")]


@dataclass(frozen=True)
class ComparedResult(ConfiguredResult[ConfigT, RunT]):
    """A ``ConfiguredResult`` and the same load under the comparison policy (``compare``; None: not run).

    A subclass shows each run with ``policy_table``; ``body()`` gives main's, then compare's."""

    compare: RunT | None

    def runs(self) -> list[RunT]:
        """``main``, then ``compare`` if it ran."""
        return [self.main] if self.compare is None else [self.main, self.compare]

    @abstractmethod
    def policy_table(self, figs: RunT) -> Any:
        """One run's table; ``title(figs)`` names it."""

    def body(self) -> list[Any]:
        return [self.policy_table(figs) for figs in self.runs()]

    def title(self, figs: RunT) -> str:
        return f"policy {figs.policy}" + (" (comparison)" if figs is self.compare else "")


def main_and_compare(options: DrillOptions, one: Callable[[str], RunT]) -> tuple[RunT, RunT | None]:
    """``one(policy)`` under ``options.policy``, and under ``options.comparison`` if there is one (else None)."""
    main = one(options.policy)
    return main, (None if options.comparison is None else one(options.comparison))


def problems_by(found: Iterable[tuple[str, list[str]]]) -> dict[str, list[str]]:
    """(what, its problems) pairs -> what -> problems, leaving out those without any."""
    return {what: problems for what, problems in found if problems}


def grouped(items: Iterable[V], key: Callable[[V], K]) -> dict[K, list[V]]:
    """``items`` by ``key(item)``, each group in their order."""
    out: dict[K, list[V]] = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return out


def table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    caption: str = "",
    left: Collection[str] = ("tenant", "errors"),
    wrap: Collection[str] = ("errors",),
) -> Any:
    """A rich table: ``columns`` right-aligned but those in ``left``, unwrapped but those in ``wrap``; the
    title and the caption on the left."""
    from rich.table import Table

    out = Table(title=title, title_justify="left", caption=caption or None, caption_justify="left")
    for column in columns:
        out.add_column(column, justify="left" if column in left else "right", no_wrap=column not in wrap)
    for row in rows:
        out.add_row(*row)
    return out


# A table's columns, each its title and how its cell is made from one row's item (``cell_table``).
Cells = Sequence[tuple[str, Callable[[V], str]]]


def cell_table(title: str, cells: Cells[V], items: Iterable[V], caption: str = "", **layout: Any) -> Any:
    """``table`` with a row per item of ``items`` and a column per cell of ``cells``: each column's title
    stands beside how its cell is made, so the two cannot drift apart. ``layout``: ``table``'s ``left`` /
    ``wrap``."""
    rows = [[cell(item) for _, cell in cells] for item in items]
    return table(title, [column for column, _ in cells], rows, caption, **layout)


class FleetSetting(Protocol):
    """A drill's setting that runs ``replicas`` emulated replicas, each ``replica``."""

    @property
    def replicas(self) -> int: ...

    @property
    def replica(self) -> ReplicaModel: ...


def fleet(setting: FleetSetting) -> str:
    """``"2 emulated replicas x 24 slots"``: the fleet a drill runs on, for its intro."""
    return f"{setting.replicas} emulated replicas x {setting.replica.max_batch} slots"


def history_check(report: HistoryReport | None, allowing: str = "") -> dict[str, bool]:
    """The history checker's verdict as one of a drill's checks (``allowing``: the allowances its fault
    justifies, said in the claim); a run that did not check its history fails it."""
    said = f" ({allowing})" if allowing else ""
    if report is None:
        return {f"history checker{said}: not run": False}
    return {f"history checker{said}: {report.requests} ids, {report.summary()}": report.ok}


def history_lines(report: HistoryReport | None, most: int = 8) -> list[str]:
    """The checker's first ``most`` discrepancies, a line each (rich markup)."""
    found = () if report is None else report.discrepancies
    return [f"  [red]history[/red] {d.kind.value} {d.subject}: {d.detail}" for d in found[:most]]


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def fmt_errors(errors: Mapping[str, int]) -> str:
    """``{"429:insufficient_quota[max_model_calls]": 3}`` -> ``"429 max_model_calls x3"`` (``-`` for none)."""
    parts = []
    for code, count in errors.items():
        status, _, rest = code.partition(":")
        detail = rest.partition("[")[2].rstrip("]") or rest
        parts.append(f"{status} {detail} x{count}" if rest else f"{code} x{count}")
    return ", ".join(parts) or "-"


def fmt_counts(counts: Mapping[Any, int], sep: str = " ") -> str:
    """``{"settled": 3, "open": 1}`` -> ``"open 1, settled 3"`` (sorted; ``sep`` between name and count)."""
    return ", ".join(f"{k}{sep}{v}" for k, v in sorted(counts.items()))


def fmt_s(value: float | None, never: str = "never") -> str:
    return never if value is None else f"{value:.2f} s"


def holds_from(points: Iterable[tuple[float, bool]]) -> float | None:
    """The first time from which a condition held at every later point ((time, holds) in time order); None if
    it did not hold at the last point."""
    since = None
    for at, holds in points:
        since = (at if since is None else since) if holds else None
    return since


def plain_text(renderables: Sequence[Any], width: int = 140) -> str:
    """Render rich objects to plain text (for ``summary()``, logs and assertion messages)."""
    import io

    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None, highlight=False)
    for item in renderables:
        console.print(item)
    return console.export_text()


__all__ = [
    "Cells",
    "ComparedResult",
    "ConfiguredResult",
    "DrillResult",
    "FleetSetting",
    "PolicyRun",
    "cell_table",
    "fleet",
    "fmt_counts",
    "fmt_errors",
    "fmt_ms",
    "fmt_s",
    "grouped",
    "history_check",
    "history_lines",
    "holds_from",
    "main_and_compare",
    "plain_text",
    "problems_by",
    "table",
]
