"""What planning a step needs of a sample, without the sample: its tokens, its targets, the rows each of its
encoder items becomes, its token fields. A user's lines are measured once, by the prescan (train/prescan.py);
every rank then plans the bins of a whole global batch from these alone (train/inputs.py `plan_shapes`) and
renders (chat template, tokenizer, media headers) and decodes only the samples its own microbatches and encoder
replicas take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.data.batch import supervised_count
from loom.data.format import TokenCounter, tower_rows
from loom.data.sample import Sample


@dataclass(frozen=True, slots=True)
class SampleShape:
    tokens: int  # len(sample): placeholders included
    targets: int  # supervised_count(sample): its labels after the shift
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)  # encoder → its items' rows, placeholder order
    fields: frozenset[str] = frozenset()  # its token fields' names (Sample.token_fields)
    where: str = ""  # file:line when measured from a sample that says it (the prescan keeps none: the dataset has it)
    # encoder → its items' rows through the tower, where they are not `rows` (anyres tiles): what balancing weighs
    tower: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.tokens

    def item_rows(self, encoder: str) -> tuple[int, ...]:
        return self.rows.get(encoder, ())

    def tower_rows(self, encoder: str) -> tuple[int, ...]:
        return self.tower.get(encoder, self.item_rows(encoder))

    def same_as(self, other: SampleShape) -> bool:
        """The same lengths, wherever each was measured."""
        return ((self.tokens, self.targets, self.rows, self.fields, self.tower)
                == (other.tokens, other.targets, other.rows, other.fields, other.tower))


def shape_of(sample: Sample, counters: dict[str, TokenCounter]) -> SampleShape:
    """A sample's shape; its media need only their headers (`counters` read a MediaFile's shape)."""
    rows = {n: tuple(c(x) for x in sample.items(n)) for n, c in counters.items() if sample.items(n)}
    tower = {n: tuple(tower_rows(c, x) for x in sample.items(n)) for n, c in counters.items() if sample.items(n)}
    return SampleShape(len(sample), supervised_count(sample), rows, frozenset(sample.token_fields), sample.where,
                       {n: r for n, r in tower.items() if r != rows[n]})

