"""A tiny Tetris as a multi-turn text environment (after the GRL game suite).

A 4-wide, 4-high board by default.  The falling piece moves only when told
(Left, Right, Down: one cell; a blocked move does nothing; no gravity).  After
every action a piece that cannot move down locks; full rows then clear for +10
each and a clear ends the episode as a success, while a locked cell in the top
row ends it as a failure.  Small boards and small pieces keep an episode within
the 40 actions a model gets.

Choices the design leaves open, made here: a new piece appears whole, its top
row on the board's top row, at a random column where it fits (GRL lets the part
above the board stay hidden); a piece that has no room to appear ends the
episode as a failure.  Piece sets are cumulative, as the design says: size 1 is
the single cell, size 2 adds the two dominoes, size 3 the 2x2 square.

Grid codes (``numeric_state``): 0 empty, 1 locked, 2 falling.  Text: ``_`` ``#`` ``X``.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar

from pydantic import Field

from producers.envs.base import ANSWER_FORMAT, ActionOutcome, EnvConfig, TextEnv
from producers.envs.parsing import format_answer, match_action

EMPTY, LOCKED, FALLING = 0, 1, 2
CHARS: dict[int, str] = {EMPTY: "_", LOCKED: "#", FALLING: "X"}

# Action names in GRL's order; the number the model may answer with is index + 1.
ACTIONS: tuple[str, ...] = ("Left", "Right", "Down")
DELTAS: dict[str, tuple[int, int]] = {"Left": (0, -1), "Right": (0, 1), "Down": (1, 0)}

Cell = tuple[int, int]  # (row from the top, column from the left)


@dataclass(frozen=True)
class Shape:
    """A piece as cell offsets from its top-left corner."""

    name: str
    cells: tuple[Cell, ...]

    @property
    def height(self) -> int:
        return 1 + max(r for r, _ in self.cells)

    @property
    def width(self) -> int:
        return 1 + max(c for _, c in self.cells)


SINGLE = Shape("single cell", ((0, 0),))
VERTICAL = Shape("vertical domino", ((0, 0), (1, 0)))
HORIZONTAL = Shape("horizontal domino", ((0, 0), (0, 1)))
SQUARE = Shape("2x2 square", ((0, 0), (0, 1), (1, 0), (1, 1)))
PIECE_SETS: dict[int, tuple[Shape, ...]] = {
    1: (SINGLE,),
    2: (SINGLE, VERTICAL, HORIZONTAL),
    3: (SINGLE, VERTICAL, HORIZONTAL, SQUARE),
}
BALANCE_BASE_WEIGHT = 5  # GRL: weight = 5 + (most drawn count - this shape's count)

Board = list[list[int]]  # rows top to bottom, EMPTY or LOCKED


def balancing_weights(counts: list[int]) -> list[int]:
    """Draw weights that favour the shapes drawn least so far (GRL's balancing)."""
    most = max(counts)
    return [BALANCE_BASE_WEIGHT + most - count for count in counts]


def next_shape_index(rng: random.Random, counts: list[int]) -> int:
    """Draw a shape index with the balancing weights and count it in ``counts``."""
    index = rng.choices(range(len(counts)), weights=balancing_weights(counts))[0]
    counts[index] += 1
    return index


def piece_cells(shape: Shape, position: Cell) -> list[Cell]:
    return [(position[0] + r, position[1] + c) for r, c in shape.cells]


def fits(board: Board, shape: Shape, position: Cell) -> bool:
    """True when every cell of the piece is on the board and empty."""
    height, width = len(board), len(board[0])
    return all(0 <= r < height and 0 <= c < width and board[r][c] == EMPTY for r, c in piece_cells(shape, position))


def lock_piece(board: Board, shape: Shape, position: Cell) -> tuple[Board, int]:
    """The board with the piece locked and full rows cleared (rows above fall), and the rows cleared."""
    locked = [row[:] for row in board]
    for r, c in piece_cells(shape, position):
        locked[r][c] = LOCKED
    kept = [row for row in locked if not all(row)]
    cleared = len(locked) - len(kept)
    return [[EMPTY] * len(board[0]) for _ in range(cleared)] + kept, cleared


def board_from_text(text: str) -> Board:
    """Parse rows of ``_`` and ``#`` (top to bottom) into a board."""
    rows = [line.strip() for line in text.strip().splitlines()]
    if not rows or len({len(row) for row in rows}) != 1 or any(ch not in "_#" for row in rows for ch in row):
        raise ValueError("tetris board text: equal-length rows of '_' (empty) and '#' (locked), top row first")
    return [[LOCKED if ch == "#" else EMPTY for ch in row] for row in rows]


class TetrisConfig(EnvConfig):
    """Tetris settings; the limits default to GRL's 11 turns, 5 actions a turn, 40 in all, 100 steps."""

    max_turns: int = Field(11, ge=1, le=100_000, description="Turns (model answers) per episode.")
    max_actions_total: int = Field(40, ge=1, le=1_000_000, description="Actions applied in one episode.")
    width: int = Field(4, ge=2, le=20, description="Board columns.")
    height: int = Field(4, ge=3, le=40, description="Board rows.")
    piece_size: int = Field(1, ge=1, le=3, description="Piece set: 1 single cell, 2 adds dominoes, 3 adds the square.")
    step_penalty: float = Field(-0.1, le=0.0, description="Reward for every action.")
    line_reward: float = Field(10.0, ge=0.0, description="Reward per cleared row (a clear ends the episode).")


class Tetris(TextEnv[str]):
    """Tetris on a 4x4 board with single-cell pieces by default."""

    name: ClassVar[str] = "tetris"
    description: ClassVar[str] = "Tetris: steer falling pieces to fill and clear a row on a small board."
    Config: ClassVar[type[EnvConfig]] = TetrisConfig

    def __init__(self, config: EnvConfig | None = None, **overrides: object) -> None:
        super().__init__(config, **overrides)
        cfg: TetrisConfig = self.config  # type: ignore[assignment]
        self.shapes = PIECE_SETS[cfg.piece_size]
        self.board: Board = []
        self.piece: Shape | None = None
        self.position: Cell = (0, 0)
        self.shape_counts = [0] * len(self.shapes)
        self.lines_cleared = 0

    # ---- hooks --------------------------------------------------------------------------
    def _reset(self, seed: int) -> None:
        cfg: TetrisConfig = self.config  # type: ignore[assignment]
        self.board = [[EMPTY] * cfg.width for _ in range(cfg.height)]
        self.shape_counts = [0] * len(self.shapes)
        self.lines_cleared = 0
        self._spawn()

    def _spawn(self) -> bool:
        """Draw the next piece (balanced) at a random column where it fits; False when it fits in none."""
        shape = self.shapes[next_shape_index(self.rng, self.shape_counts)]
        columns = [c for c in range(len(self.board[0]) - shape.width + 1) if fits(self.board, shape, (0, c))]
        # (when every column fits, as always with single cells, the draw is the one a plain randint made)
        self.piece, self.position = shape, (0, self.rng.choice(columns) if columns else 0)
        return bool(columns)

    def set_state(self, board: Board | str, piece: Shape, position: Cell) -> None:
        """Play from a hand-built board and piece (tests, demonstrations); call after ``reset``."""
        grid = board_from_text(board) if isinstance(board, str) else [row[:] for row in board]
        if not fits(grid, piece, position):
            raise ValueError(f"tetris: the {piece.name} at {position} overlaps the board or leaves it")
        self.board, self.piece, self.position = grid, piece, position

    def _parse_action(self, text: str) -> str | None:
        return match_action(text, ACTIONS)

    def action_help(self) -> str:
        return "answer Left, Right or Down"

    def _apply_action(self, action: str) -> ActionOutcome:
        cfg: TetrisConfig = self.config  # type: ignore[assignment]
        piece = self._require_piece()
        moved = self._try_move(action)
        if fits(self.board, piece, (self.position[0] + 1, self.position[1])):
            return ActionOutcome(cfg.step_penalty, effective=moved)
        # the piece cannot move down: it locks
        self.board, cleared = lock_piece(self.board, piece, self.position)
        self.lines_cleared += cleared
        self.piece = None
        reward = cfg.step_penalty + cfg.line_reward * cleared
        if cleared:
            return ActionOutcome(reward, terminated=True, success=True)
        if any(self.board[0]) or not self._spawn():
            self.piece = None
            return ActionOutcome(reward, terminated=True, success=False)
        return ActionOutcome(reward)

    def _try_move(self, action: str) -> bool:
        dr, dc = DELTAS[action]
        target = (self.position[0] + dr, self.position[1] + dc)
        if fits(self.board, self._require_piece(), target):
            self.position = target
            return True
        return False

    def _require_piece(self) -> Shape:
        if self.piece is None:
            raise RuntimeError(f"{self.name}: no falling piece; call reset(seed) first")
        return self.piece

    def grid(self) -> list[list[int]]:
        """The board with the falling piece drawn in (codes 0-2)."""
        grid = [row[:] for row in self.board]
        if self.piece is not None:
            for r, c in piece_cells(self.piece, self.position):
                grid[r][c] = FALLING
        return grid

    def _render(self) -> str:
        rows = "\n".join("".join(CHARS[code] for code in row) for row in self.grid())
        piece = f"Falling piece: {self.piece.name}." if self.piece is not None else "No falling piece."
        return f"{rows}\n{piece} Rows cleared: {self.lines_cleared}."

    # ---- prompt and numbers -------------------------------------------------------------
    def system_prompt(self) -> str:
        cfg = self.config
        return (
            "You are playing Tetris on a small board. Fill a whole row to clear it.\n"
            "Legend: _ empty, # locked, X falling piece (rows shown top to bottom).\n"
            "Actions: Left (1), Right (2), Down (3), each one cell; a blocked move does nothing and there is "
            "no gravity. After any action, a piece that cannot move down locks and a new piece appears.\n"
            f"Rewards: {cfg.step_penalty:+g} per action, {cfg.line_reward:+g} per cleared row. Clearing a row ends "
            "the game (you win); a locked "
            "cell in the top row ends it (you lose).\n"
            f"Up to {cfg.max_actions_per_turn} actions per answer, {cfg.max_actions_total} in all.\n"
            f"{ANSWER_FORMAT}"
        )

    def numeric_state(self) -> list[float]:
        return [float(code) for row in self.grid() for code in row] if self.board else []

    def action_vector(self, action: str) -> list[float]:
        return [float(ACTIONS.index(action) + 1)]

    def features(self) -> dict[str, float]:
        return {"lines_cleared": float(self.lines_cleared), "stack_height": float(stack_height(self.board))}

    # ---- policies ---------------------------------------------------------------------
    def _action_budget(self) -> int:
        cfg = self.config
        return max(1, min(cfg.max_actions_per_turn, cfg.max_actions_total - self.actions_used))

    def heuristic_answer(self) -> str:
        """Steer the piece to the reachable resting place that scores best (see ``placement_score``)."""
        piece = self._require_piece()
        placements = reachable_placements(self.board, piece, self.position)
        if not placements:
            return format_answer(["Down"])
        best = max(placements, key=lambda pos: (placement_score(self.board, piece, pos), -len(placements[pos])))
        return format_answer(list(placements[best][: self._action_budget()]))

    def random_answer(self, rng: random.Random) -> str:
        return format_answer([rng.choice(ACTIONS) for _ in range(self._action_budget())])


def stack_height(board: Board) -> int:
    """The height of the tallest column (0 for an empty board)."""
    for r, row in enumerate(board):
        if any(row):
            return len(board) - r
    return 0


def reachable_placements(board: Board, piece: Shape, start: Cell) -> dict[Cell, tuple[str, ...]]:
    """Every position where the piece would lock, with a shortest action sequence to it.

    Mirrors the rules: after each action the piece locks if it cannot move down,
    so a resting position ends its path.
    """
    found: dict[Cell, tuple[str, ...]] = {}
    seen = {start}
    queue: deque[tuple[Cell, tuple[str, ...]]] = deque([(start, ())])
    while queue:
        position, path = queue.popleft()
        for action in ACTIONS:
            dr, dc = DELTAS[action]
            nxt = (position[0] + dr, position[1] + dc)
            if not fits(board, piece, nxt):
                nxt = position
            route = (*path, action)
            if not fits(board, piece, (nxt[0] + 1, nxt[1])):
                found.setdefault(nxt, route)
            elif nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, route))
    return found


def placement_score(board: Board, piece: Shape, position: Cell) -> float:
    """Higher is better: clear rows, never touch the top row, then stay low, flat and hole-free."""
    after, cleared = lock_piece(board, piece, position)
    if cleared:
        return 1_000.0 * cleared
    if any(after[0]):
        return -1_000.0
    columns = list(zip(*after, strict=True))
    heights = [next((len(col) - r for r, cell in enumerate(col) if cell), 0) for col in columns]
    holes = sum(1 for col, h in zip(columns, heights, strict=True) for cell in col[len(col) - h:] if not cell)
    fullest_row = max(sum(row) for row in after)
    bumpiness = sum(abs(a - b) for a, b in pairwise(heights))
    return 2.0 * fullest_row - 4.0 * holes - 1.0 * sum(heights) - 0.5 * bumpiness
