"""Sokoban as a multi-turn text environment (after the GRL game suite / gym-sokoban).

The player walks a walled room and pushes every box onto a target.  Levels are
generated the way gym-sokoban does it, so they are always solvable: carve a room
by a random walk, put the boxes on their targets, then play *backwards* (the
player pulls boxes) and keep the scrambled state that scores best
(box moves x total box distance from the targets).  A forward solution is the
reverse of those pulls, so every generated level has one.

Grid codes (``numeric_state``): 0 wall, 1 floor, 2 target, 3 box on target,
4 box, 5 player, 6 player on a target.  Text: ``#`` ``_`` ``O`` ``√`` ``X`` ``P`` ``S``.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from producers.envs.base import ANSWER_FORMAT, ActionOutcome, EnvConfig, TextEnv
from producers.envs.parsing import format_answer, match_action

WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)
CHARS: dict[int, str] = {
    WALL: "#", FLOOR: "_", TARGET: "O", BOX_ON_TARGET: "√", BOX: "X", PLAYER: "P", PLAYER_ON_TARGET: "S",
}
CODES: dict[str, int] = {char: code for code, char in CHARS.items()}

# Action names in their GRL order; the number the model may answer with is index + 1.
ACTIONS: tuple[str, ...] = ("Up", "Down", "Left", "Right")
DELTAS: dict[str, tuple[int, int]] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}

# Floor stamps of the room-carving random walk (gym-sokoban's masks), centred on the walker.
CARVE_MASKS: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
REVERSE_SEARCH_MAX_STATES = 300_000  # gym-sokoban's cap on states explored by reverse play

Cell = tuple[int, int]
RoomSide = Annotated[int, Field(ge=4, le=16)]


# ---- levels -----------------------------------------------------------------
@dataclass(frozen=True)
class SokobanLevel:
    """One Sokoban state: the fixed room (walls, floor, targets), the boxes and the player."""

    fixed: tuple[tuple[int, ...], ...]  # WALL / FLOOR / TARGET only
    boxes: frozenset[Cell]
    player: Cell

    @property
    def targets(self) -> frozenset[Cell]:
        return frozenset((r, c) for r, row in enumerate(self.fixed) for c, code in enumerate(row) if code == TARGET)

    @property
    def boxes_on_target(self) -> int:
        return sum(1 for r, c in self.boxes if self.fixed[r][c] == TARGET)

    @property
    def solved(self) -> bool:
        return self.boxes_on_target == len(self.boxes)

    def code_at(self, cell: Cell) -> int:
        """The grid code of ``cell`` with the movable pieces drawn in."""
        on_target = self.fixed[cell[0]][cell[1]] == TARGET
        if cell == self.player:
            return PLAYER_ON_TARGET if on_target else PLAYER
        if cell in self.boxes:
            return BOX_ON_TARGET if on_target else BOX
        return self.fixed[cell[0]][cell[1]]

    def grid(self) -> list[list[int]]:
        return [[self.code_at((r, c)) for c in range(len(row))] for r, row in enumerate(self.fixed)]

    def render(self) -> str:
        return "\n".join("".join(CHARS[code] for code in row) for row in self.grid())

    @classmethod
    def from_text(cls, text: str) -> SokobanLevel:
        """Parse a rendered grid (the inverse of ``render``); handy for hand-built puzzles."""
        rows = [line.strip() for line in text.strip().splitlines()]
        if len({len(row) for row in rows}) != 1:
            raise ValueError("sokoban level text: every row must have the same length")
        fixed: list[tuple[int, ...]] = []
        boxes: set[Cell] = set()
        players: list[Cell] = []
        for r, row in enumerate(rows):
            fixed_row = []
            for c, char in enumerate(row):
                if char not in CODES:
                    raise ValueError(f"sokoban level text: unknown cell {char!r}; use one of {''.join(CODES)}")
                code = CODES[char]
                if code in (BOX, BOX_ON_TARGET):
                    boxes.add((r, c))
                if code in (PLAYER, PLAYER_ON_TARGET):
                    players.append((r, c))
                on_target = code in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET)
                fixed_row.append(WALL if code == WALL else TARGET if on_target else FLOOR)
            fixed.append(tuple(fixed_row))
        if len(players) != 1:
            raise ValueError(f"sokoban level text: need exactly one player (P or S), found {len(players)}")
        return cls(tuple(fixed), frozenset(boxes), players[0])


def apply_move(level: SokobanLevel, action: str) -> SokobanLevel:
    """The level after one move: push a box if the cell behind it is free, else walk if free, else stay."""
    dr, dc = DELTAS[action]
    pr, pc = level.player
    ahead = (pr + dr, pc + dc)
    if level.fixed[ahead[0]][ahead[1]] == WALL:
        return level
    if ahead in level.boxes:
        behind = (ahead[0] + dr, ahead[1] + dc)
        if level.fixed[behind[0]][behind[1]] == WALL or behind in level.boxes:
            return level
        return SokobanLevel(level.fixed, (level.boxes - {ahead}) | {behind}, ahead)
    return SokobanLevel(level.fixed, level.boxes, ahead)


def offset_words(frm: Cell, to: Cell) -> str:
    """Where ``to`` lies from ``frm`` in moves: ``"2 Down and 1 Left"``; ``"here"`` when they coincide."""
    dr, dc = to[0] - frm[0], to[1] - frm[1]
    words = [f"{abs(dr)} {'Down' if dr > 0 else 'Up'}"] if dr else []
    words += [f"{abs(dc)} {'Right' if dc > 0 else 'Left'}"] if dc else []
    return " and ".join(words) or "here"


def describe_positions(level: SokobanLevel) -> str:
    """The pieces in words: each box from the player, its nearest free target from the box, walls next to the player.

    The ``positions`` observation: the same state as the grid, with the relations a
    move depends on spelled out, for a model too small to read them off a grid.
    """
    lines = []
    free_targets = sorted(level.targets - level.boxes)  # non-empty while any box is off its target
    for i, box in enumerate(sorted(level.boxes), start=1):
        name = "The box" if len(level.boxes) == 1 else f"Box {i}"
        lines.append(f"{name} is {offset_words(level.player, box)} of you.")
        if level.fixed[box[0]][box[1]] == TARGET:
            lines.append(f"{name} is on a target.")
            continue
        target = min(free_targets, key=lambda t: abs(t[0] - box[0]) + abs(t[1] - box[1]))
        lines.append(f"Its target is {offset_words(box, target)} of it.")
    pr, pc = level.player
    walls = [a for a in ACTIONS if level.fixed[pr + DELTAS[a][0]][pc + DELTAS[a][1]] == WALL]
    lines.append(f"Walls next to you: {', '.join(walls) if walls else 'none'}.")
    return "\n".join(lines)


# ---- solver -------------------------------------------------------------------
def _dead_cells(level: SokobanLevel) -> frozenset[Cell]:
    """Non-target corner cells: a box pushed there can never move again."""
    dead = set()
    for r, row in enumerate(level.fixed):
        for c, code in enumerate(row):
            if code != FLOOR:
                continue
            vertical = level.fixed[r - 1][c] == WALL or level.fixed[r + 1][c] == WALL
            horizontal = level.fixed[r][c - 1] == WALL or level.fixed[r][c + 1] == WALL
            if vertical and horizontal:
                dead.add((r, c))
    return frozenset(dead)


def solve(level: SokobanLevel, max_states: int = 200_000) -> list[str] | None:
    """A shortest move sequence that places every box (breadth-first search over (player, boxes)).

    Returns ``[]`` if the level is already solved and ``None`` when it is unsolvable or
    the search would visit more than ``max_states`` states (big rooms, many boxes).
    Boxes in dead corners are pruned, which never removes a solution.
    """
    if level.solved:
        return []
    dead = _dead_cells(level)
    start = (level.player, level.boxes)
    parents: dict[tuple[Cell, frozenset[Cell]], tuple[tuple[Cell, frozenset[Cell]], str] | None] = {start: None}
    frontier = deque([level])
    while frontier:
        current = frontier.popleft()
        for action in ACTIONS:
            nxt = apply_move(current, action)
            key = (nxt.player, nxt.boxes)
            if key in parents or (nxt.boxes & dead):
                continue
            parents[key] = ((current.player, current.boxes), action)
            if nxt.solved:
                return _backtrack(parents, key)
            if len(parents) > max_states:
                return None
            frontier.append(nxt)
    return None


def _backtrack(parents: dict, key: tuple) -> list[str]:
    actions: list[str] = []
    while parents[key] is not None:
        key, action = parents[key]
        actions.append(action)
    return actions[::-1]


# ---- level generation -------------------------------------------------------------
def carve_room(
    rng: random.Random, dim_room: tuple[int, int], num_steps: int, p_change_directions: float
) -> list[list[int]]:
    """Floor carved by a random walk stamping small masks; the border is always wall."""
    rows, cols = dim_room
    grid = [[WALL] * cols for _ in range(rows)]
    directions = list(DELTAS.values())
    direction = rng.choice(directions)
    r, c = rng.randint(1, rows - 1), rng.randint(1, cols - 1)
    for _ in range(num_steps):
        if rng.random() < p_change_directions:
            direction = rng.choice(directions)
        r = max(min(r + direction[0], rows - 2), 1)
        c = max(min(c + direction[1], cols - 2), 1)
        mask = rng.choice(CARVE_MASKS)
        for i in range(3):
            for j in range(3):
                if mask[i][j]:
                    grid[r - 1 + i][c - 1 + j] = FLOOR
    for r in range(rows):  # border forced to wall
        for c in range(cols):
            if r in (0, rows - 1) or c in (0, cols - 1):
                grid[r][c] = WALL
    return grid


def place_targets_and_player(rng: random.Random, grid: list[list[int]], num_boxes: int) -> SokobanLevel | None:
    """Player and targets on random floor cells, every box on its target (the solved state)."""
    floor = [(r, c) for r, row in enumerate(grid) for c, code in enumerate(row) if code == FLOOR]
    if len(floor) <= num_boxes + 1:
        return None
    player = floor.pop(rng.randrange(len(floor)))
    targets = [floor.pop(rng.randrange(len(floor))) for _ in range(num_boxes)]
    fixed = [list(row) for row in grid]
    for r, c in targets:
        fixed[r][c] = TARGET
    return SokobanLevel(tuple(tuple(row) for row in fixed), frozenset(targets), player)


def reverse_play(solved: SokobanLevel, search_depth: int) -> tuple[SokobanLevel, int]:
    """Scramble a solved level by pulling boxes; return the best state and its score.

    Depth-first over reverse moves (pull then plain move, each Up/Down/Left/Right),
    each state explored once, paths at most ``search_depth`` deep, as gym-sokoban does.
    score = box moves (pulls) on the path x summed Manhattan distance of each box from
    its own target, and 0 while any box sits on a target.
    """
    targets = tuple(sorted(solved.boxes))
    target_set = frozenset(targets)
    best, best_score = solved, 0
    explored: set[tuple[Cell, frozenset[Cell]]] = set()
    # stack entries: (player, box positions indexed like ``targets``, pulls, depth)
    stack: list[tuple[Cell, tuple[Cell, ...], int, int]] = [(solved.player, targets, 0, 0)]
    while stack and len(explored) < REVERSE_SEARCH_MAX_STATES:
        player, boxes, pulls, depth = stack.pop()
        key = (player, frozenset(boxes))
        if key in explored:
            continue
        explored.add(key)
        score = 0 if target_set & key[1] else pulls * sum(
            abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets, strict=True)
        )
        if score > best_score:
            best, best_score = SokobanLevel(solved.fixed, key[1], player), score
        if depth + 1 >= search_depth:
            continue
        children = [_reverse_move(solved.fixed, player, boxes, pulls, DELTAS[a], pull) for pull in (True, False)
                    for a in ACTIONS]
        stack.extend((p, b, n, depth + 1) for p, b, n in reversed([c for c in children if c is not None]))
    return best, best_score


def _reverse_move(fixed: tuple[tuple[int, ...], ...], player: Cell, boxes: tuple[Cell, ...], pulls: int,
                  delta: tuple[int, int], pull: bool) -> tuple[Cell, tuple[Cell, ...], int] | None:
    """Step the player to a free cell, dragging the box behind it along when ``pull``."""
    ahead = (player[0] + delta[0], player[1] + delta[1])
    if fixed[ahead[0]][ahead[1]] == WALL or ahead in boxes:
        return None
    behind = (player[0] - delta[0], player[1] - delta[1])
    if pull and behind in boxes:
        return ahead, tuple(player if b == behind else b for b in boxes), pulls + 1
    return ahead, boxes, pulls


def generate_level(rng: random.Random, dim_room: tuple[int, int], num_boxes: int, num_steps: int,
                   p_change_directions: float, search_depth: int, max_attempts: int) -> SokobanLevel:
    """A solvable scrambled level; a candidate scoring 0 is rejected and another drawn from ``rng``."""
    for _ in range(max_attempts):
        room = carve_room(rng, dim_room, num_steps, p_change_directions)
        solved = place_targets_and_player(rng, room, num_boxes)
        if solved is None:
            continue
        level, score = reverse_play(solved, search_depth)
        if score > 0:
            return level
    raise RuntimeError(
        f"sokoban: no level with score > 0 in {max_attempts} attempts for a {dim_room} room with {num_boxes} "
        "boxes; use a bigger dim_room, fewer num_boxes or more num_gen_steps"
    )


@lru_cache(maxsize=256)
def cached_level(seed: int, dim_room: tuple[int, int], num_boxes: int, num_steps: int, p_change_directions: float,
                 search_depth: int, max_attempts: int) -> tuple[SokobanLevel, tuple]:
    """``generate_level`` from ``random.Random(seed)``, and that generator's state after it, generated once.

    The episodes of a group share a seed, and the reverse play of scrambling is most of a reset; a level is
    immutable, and restoring the state leaves the environment's generator where generating would have.
    """
    rng = random.Random(seed)
    level = generate_level(rng, dim_room, num_boxes, num_steps, p_change_directions, search_depth, max_attempts)
    return level, rng.getstate()


# ---- environment ------------------------------------------------------------------
class SokobanConfig(EnvConfig):
    """Sokoban settings; the limits default to GRL's 6 turns, 5 actions a turn, 10 in all, 100 steps."""

    dim_room: tuple[RoomSide, RoomSide] = Field((6, 6), description="Room size (rows, columns), border included.")
    num_boxes: int = Field(1, ge=1, le=8, description="Boxes (and targets) in a level.")
    num_gen_steps: int | None = Field(
        None, ge=1, le=10_000, description="Room-carving walk length; None = int(1.7 * (rows + columns)).",
    )
    p_change_directions: float = Field(0.35, ge=0.0, le=1.0, description="Chance the carving walk turns each step.")
    search_depth: int = Field(300, ge=1, le=10_000, description="Longest reverse-play path when scrambling a level.")
    max_generation_attempts: int = Field(1_000, ge=1, le=1_000_000, description="Rooms tried before giving up.")
    solver_max_states: int = Field(200_000, ge=1, le=50_000_000, description="States the heuristic's solver may visit.")
    step_penalty: float = Field(-0.1, le=0.0, description="Reward for every action.")
    box_on_target_reward: float = Field(1.0, ge=0.0, description="Reward when a box lands on a target.")
    box_off_target_penalty: float = Field(-1.0, le=0.0, description="Reward when a box leaves a target.")
    finish_reward: float = Field(10.0, ge=0.0, description="Reward when every box is on a target (success).")
    observation: Literal["grid", "positions", "both"] = Field(
        "grid", description=(
            "What the model sees: the rendered grid (GRL's), the pieces' relative positions and the walls "
            "next to the player in words, or both."
        ),
    )
    per_turn: bool = Field(
        False, description="Each turn its own prompt and row (history_turns of context) instead of one growing chat.",
    )


class SokobanLargeConfig(SokobanConfig):
    """The large variant: an 8x8 room with 2 boxes."""

    dim_room: tuple[RoomSide, RoomSide] = Field((8, 8), description="Room size (rows, columns), border included.")
    num_boxes: int = Field(2, ge=1, le=8, description="Boxes (and targets) in a level.")


class Sokoban(TextEnv[str]):
    """Sokoban in a 6x6 room (border included) with one box."""

    name: ClassVar[str] = "sokoban"
    description: ClassVar[str] = "Sokoban: push every box onto a target in a walled room."
    Config: ClassVar[type[EnvConfig]] = SokobanConfig

    def __init__(self, config: EnvConfig | None = None, **overrides: object) -> None:
        super().__init__(config, **overrides)
        self.level: SokobanLevel | None = None
        self._plans: dict[tuple[Cell, frozenset[Cell]], tuple[str, ...]] = {}

    # ---- hooks ------------------------------------------------------------------------
    def _reset(self, seed: int) -> None:
        cfg: SokobanConfig = self.config  # type: ignore[assignment]
        num_steps = cfg.num_gen_steps or int(1.7 * (cfg.dim_room[0] + cfg.dim_room[1]))
        level, rng_state = cached_level(seed, tuple(cfg.dim_room), cfg.num_boxes, num_steps, cfg.p_change_directions,
                                        cfg.search_depth, cfg.max_generation_attempts)
        self.rng.setstate(rng_state)
        self.set_level(level)

    def set_level(self, level: SokobanLevel) -> None:
        """Play ``level`` from now on (hand-built puzzles, tests); call after ``reset``."""
        self.level = level
        self._plans = {}

    def _parse_action(self, text: str) -> str | None:
        return match_action(text, ACTIONS)

    def _apply_action(self, action: str) -> ActionOutcome:
        cfg: SokobanConfig = self.config  # type: ignore[assignment]
        before = self._require_level()
        after = apply_move(before, action)
        self.level = after
        placed = after.boxes_on_target - before.boxes_on_target
        reward = cfg.step_penalty
        if placed > 0:
            reward += cfg.box_on_target_reward
        elif placed < 0:
            reward += cfg.box_off_target_penalty
        if after.solved:
            return ActionOutcome(reward + cfg.finish_reward, effective=True, terminated=True, success=True)
        return ActionOutcome(reward, effective=after != before)

    def _render(self) -> str:
        level = self._require_level()
        mode = self.config.observation  # type: ignore[attr-defined]
        parts = [level.render()] if mode in ("grid", "both") else []
        parts += [describe_positions(level)] if mode in ("positions", "both") else []
        return "\n".join([*parts, f"Boxes on targets: {level.boxes_on_target}/{len(level.boxes)}"])

    def per_turn_prompts(self) -> bool:
        return bool(self.config.per_turn)  # type: ignore[attr-defined]

    def _require_level(self) -> SokobanLevel:
        if self.level is None:
            raise RuntimeError(f"{self.name}: no level yet; call reset(seed) first")
        return self.level

    # ---- prompt and numbers -------------------------------------------------------------
    def system_prompt(self) -> str:
        cfg = self.config
        return (
            "You are solving a Sokoban puzzle. Push every box onto a target.\n"
            "Legend: # wall, _ floor, O target, √ box on target, X box, P player, S player on a target.\n"
            "Actions: Up (1), Down (2), Left (3), Right (4). Walking into a box pushes it one cell if the "
            "cell behind it is floor or an empty target; you cannot pull boxes or push two at once.\n"
            f"Rewards: {cfg.step_penalty:+g} per action, {cfg.box_on_target_reward:+g} when a box lands on a target, "
            f"{cfg.box_off_target_penalty:+g} when one leaves, "
            f"{cfg.finish_reward:+g} when every box is on a target (the episode then ends).\n"
            f"Up to {cfg.max_actions_per_turn} actions per answer, {cfg.max_actions_total} in all.\n"
            f"{ANSWER_FORMAT}"
        )

    def numeric_state(self) -> list[float]:
        return [float(code) for row in self._require_level().grid() for code in row]

    def action_vector(self, action: str) -> list[float]:
        return [float(ACTIONS.index(action) + 1)]

    def features(self) -> dict[str, float]:
        return {"boxes_on_target": float(self._require_level().boxes_on_target)}

    # ---- policies ---------------------------------------------------------------------
    def _action_budget(self) -> int:
        cfg = self.config
        return max(1, min(cfg.max_actions_per_turn, cfg.max_actions_total - self.actions_used))

    def heuristic_answer(self) -> str:
        """The next moves of a shortest solution (BFS solver); any moving action if none is found."""
        level = self._require_level()
        plan = self._plan(level)
        if plan:
            return format_answer(list(plan[: self._action_budget()]))
        moving = [a for a in ACTIONS if apply_move(level, a) != level]
        return format_answer([moving[0] if moving else ACTIONS[0]])

    def _plan(self, level: SokobanLevel) -> tuple[str, ...] | None:
        """The solution from ``level``, cached for every state along it (one search per episode)."""
        key = (level.player, level.boxes)
        if key not in self._plans:
            solution = solve(level, self.config.solver_max_states)  # type: ignore[attr-defined]
            if solution is None:
                return None
            state = level
            for i, action in enumerate(solution):
                self._plans[(state.player, state.boxes)] = tuple(solution[i:])
                state = apply_move(state, action)
        return self._plans.get(key)

    def random_answer(self, rng: random.Random) -> str:
        return format_answer([rng.choice(ACTIONS) for _ in range(self._action_budget())])

    def action_help(self) -> str:
        return "answer Up, Down, Left or Right"

    def answer_choices(self) -> list[str] | None:
        """The four single moves when an answer holds one action (``max_actions_per_turn: 1``)."""
        return [format_answer([a]) for a in ACTIONS] if self.config.max_actions_per_turn == 1 else None


class SokobanLarge(Sokoban):
    """Sokoban in an 8x8 room (border included) with 2 boxes: longer solutions, room to get stuck."""

    name: ClassVar[str] = "sokoban-large"
    description: ClassVar[str] = "Sokoban (large): push both boxes onto targets in an 8x8 walled room."
    Config: ClassVar[type[EnvConfig]] = SokobanLargeConfig
