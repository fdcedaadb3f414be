"""CartPole and Acrobot: the classic-control tasks Dopamine uses, as text environments.

The physics follow the reference (OpenAI Gym's ``CartPole-v0``/``-v1`` and
``Acrobot-v1``) exactly: same constants, Euler integration for CartPole, one RK4
step over ``dt`` for Acrobot ("book" dynamics), angle wrapping and velocity
clipping, the same termination tests and rewards.  The integrators are pure
functions on plain tuples (``cartpole_step``, ``acrobot_step``) so tests and
other code can drive them from fixed states without an environment.

Both are long-horizon: the producer starts a fresh prompt each turn, so each
turn is one action (``max_actions_per_turn=1``) and every limit equals the
truncation limit (200 for v0, 500 for v1 and Acrobot); setting ``max_env_steps``
alone moves the other limits with it (``LongHorizonConfig``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import ClassVar

from pydantic import Field

from producers.envs.base import ANSWER_FORMAT, ActionOutcome, EnvConfig, LongHorizonConfig, TextEnv
from producers.envs.parsing import format_answer

CartPoleState = tuple[float, float, float, float]  # x (m), x_dot (m/s), theta (rad), theta_dot (rad/s)
AcrobotState = tuple[float, float, float, float]  # theta1, theta2 (rad), dtheta1, dtheta2 (rad/s)

LEFT, RIGHT = 0, 1
_CARTPOLE_WORDS = {"left": LEFT, "right": RIGHT, "0": LEFT, "1": RIGHT}
_ACROBOT_WORDS = {
    "-1": -1, "+1": 1, "1": 1, "0": 0, "+0": 0, "-0": 0,
    "negative": -1, "minus": -1, "left": -1,
    "zero": 0, "none": 0, "noop": 0,
    "positive": 1, "plus": 1, "right": 1,
}
_TORQUE_TEXT = {-1: "-1", 0: "0", 1: "+1"}


# ---- CartPole ----------------------------------------------------------------


class CartPoleConfig(LongHorizonConfig):
    """CartPole-v0: Gym's published constants; truncation at 200 steps."""

    max_turns: int = Field(200, ge=1, le=100_000, description="Turns per episode (one action each).")
    max_actions_per_turn: int = Field(1, ge=1, le=1_000, description="Actions applied from one answer.")
    max_actions_total: int = Field(200, ge=1, le=1_000_000, description="Actions applied in one episode.")
    max_env_steps: int = Field(200, ge=1, le=10_000_000, description="Truncation limit (environment steps).")
    history_turns: int = Field(2, ge=0, le=64, description="Recent turns the producer keeps in context.")
    gravity: float = Field(9.8, gt=0.0, le=100.0, description="Gravity (m/s^2).")
    cart_mass: float = Field(1.0, gt=0.0, le=100.0, description="Cart mass (kg).")
    pole_mass: float = Field(0.1, gt=0.0, le=100.0, description="Pole mass (kg).")
    half_length: float = Field(0.5, gt=0.0, le=10.0, description="Half the pole's length (m).")
    force: float = Field(10.0, gt=0.0, le=1_000.0, description="Magnitude of the push (N).")
    dt: float = Field(0.02, gt=0.0, le=1.0, description="Euler time step (s).")
    x_threshold: float = Field(2.4, gt=0.0, le=100.0, description="Episode ends when |x| exceeds this (m).")
    angle_threshold_deg: float = Field(12.0, gt=0.0, lt=180.0, description="Ends when |angle| exceeds this (deg).")
    init_range: float = Field(0.05, ge=0.0, le=1.0, description="Start state uniform in +/- this, per variable.")


class CartPoleV1Config(CartPoleConfig):
    """CartPole-v1: the same system, truncation at 500 steps."""

    max_turns: int = Field(500, ge=1, le=100_000, description="Turns per episode (one action each).")
    max_actions_total: int = Field(500, ge=1, le=1_000_000, description="Actions applied in one episode.")
    max_env_steps: int = Field(500, ge=1, le=10_000_000, description="Truncation limit (environment steps).")


def cartpole_step(state: Sequence[float], action: int, params: CartPoleConfig) -> CartPoleState:
    """One Euler step of the cart-pole; ``action`` 1 pushes right, 0 pushes left.

    Equations (Barto, Sutton & Anderson 1983, as in Gym), with m = pole mass,
    M = cart + pole mass, l = half length:
      temp      = (F + m l thdot^2 sin th) / M
      thacc     = (g sin th - cos th * temp) / (l (4/3 - m cos^2 th / M))
      xacc      = temp - m l thacc cos th / M
    then x += dt x_dot, x_dot += dt xacc, th += dt th_dot, th_dot += dt thacc
    (positions use the old velocities: explicit Euler).
    """
    x, x_dot, theta, theta_dot = state
    force = params.force if action == RIGHT else -params.force
    total_mass = params.cart_mass + params.pole_mass
    polemass_length = params.pole_mass * params.half_length
    cos_t, sin_t = math.cos(theta), math.sin(theta)
    temp = (force + polemass_length * theta_dot**2 * sin_t) / total_mass
    theta_acc = (params.gravity * sin_t - cos_t * temp) / (
        params.half_length * (4.0 / 3.0 - params.pole_mass * cos_t**2 / total_mass)
    )
    x_acc = temp - polemass_length * theta_acc * cos_t / total_mass
    dt = params.dt
    return (x + dt * x_dot, x_dot + dt * x_acc, theta + dt * theta_dot, theta_dot + dt * theta_acc)


def cartpole_angle_threshold(params: CartPoleConfig) -> float:
    """The angle limit in radians, computed as Gym does (deg * 2 pi / 360)."""
    return params.angle_threshold_deg * 2 * math.pi / 360


def cartpole_terminated(state: Sequence[float], params: CartPoleConfig) -> bool:
    """True once the cart leaves the track or the pole leans too far (strictly beyond the limits)."""
    x, _, theta, _ = state
    return abs(x) > params.x_threshold or abs(theta) > cartpole_angle_threshold(params)


def cartpole_heuristic(state: Sequence[float]) -> int:
    """Push towards where the pole is falling: sign of a PD-like blend of angle and angular velocity.

    The small cart terms (same sign, as in an LQR controller for this system) stop
    the slow drift off the track that a pure angle controller shows over 500 steps.
    """
    x, x_dot, theta, theta_dot = state
    lean = theta + 0.5 * theta_dot + 0.02 * x + 0.1 * x_dot
    return RIGHT if lean > 0 else LEFT


class CartPole(TextEnv[int]):
    """Balance a pole on a cart by pushing it left or right each step."""

    name: ClassVar[str] = "cartpole"
    long_horizon: ClassVar[bool] = True
    description: ClassVar[str] = (
        "CartPole: keep a pole balanced upright on a moving cart by pushing the cart left or right. "
        "+1 per step until the pole falls past 12 degrees or the cart leaves the track (|x| > 2.4)."
    )
    Config: ClassVar[type[EnvConfig]] = CartPoleConfig

    def _reset(self, seed: int) -> None:
        r = self.config.init_range
        self.state: CartPoleState = tuple(self.rng.uniform(-r, r) for _ in range(4))  # type: ignore[assignment]

    def _parse_action(self, text: str) -> int | None:
        return _CARTPOLE_WORDS.get(text.strip().lower())

    def _apply_action(self, action: int) -> ActionOutcome:
        self.state = cartpole_step(self.state, action, self.config)
        terminated = cartpole_terminated(self.state, self.config)
        # Gym pays +1 on every step, the terminating one included.
        survived = not terminated and self.env_steps + 1 >= self.config.max_env_steps
        return ActionOutcome(reward=1.0, terminated=terminated, success=survived)

    def _render(self) -> str:
        x, x_dot, theta, theta_dot = self.state
        cfg = self.config
        return (
            f"Step {self.env_steps} of {cfg.max_env_steps}.\n"
            f"Cart position: {x:+.3f} (track ends at +/-{cfg.x_threshold:g})\n"
            f"Cart velocity: {x_dot:+.3f}\n"
            f"Pole angle: {theta:+.3f} rad ({math.degrees(theta):+.1f} degrees; falls beyond "
            f"+/-{cfg.angle_threshold_deg:g}; positive leans right)\n"
            f"Pole angular velocity: {theta_dot:+.3f} rad/s\n"
            "Actions: left (push the cart left) or right (push the cart right)."
        )

    def system_prompt(self) -> str:
        return (
            f"{self.description}\n"
            "Each turn you see the cart position and velocity and the pole angle and angular velocity. "
            "Answer with one action: left or right (or 0 / 1). Pushing the cart towards the side the pole "
            "leans to brings it back up.\n"
            f"{ANSWER_FORMAT}"
        )

    def numeric_state(self) -> list[float]:
        return list(self.state)

    def action_vector(self, action: int) -> list[float]:
        return [float(action)]

    def heuristic_answer(self) -> str:
        return format_answer(["right" if cartpole_heuristic(self.state) == RIGHT else "left"])

    def random_answer(self, rng: random.Random) -> str:
        return format_answer([rng.choice(["left", "right"])])

    def answer_choices(self) -> list[str]:
        return [format_answer(["left"]), format_answer(["right"])]

    def action_help(self) -> str:
        return "answer left or right"


class CartPoleV1(CartPole):
    """CartPole-v1: the same task with truncation at 500 steps."""

    name: ClassVar[str] = "cartpole-v1"
    description: ClassVar[str] = CartPole.description + " Episodes last at most 500 steps."
    Config: ClassVar[type[EnvConfig]] = CartPoleV1Config


# ---- Acrobot -----------------------------------------------------------------


class AcrobotConfig(LongHorizonConfig):
    """Acrobot-v1: Gym's published constants ("book" dynamics); truncation at 500 steps."""

    max_turns: int = Field(500, ge=1, le=100_000, description="Turns per episode (one action each).")
    max_actions_per_turn: int = Field(1, ge=1, le=1_000, description="Actions applied from one answer.")
    max_actions_total: int = Field(500, ge=1, le=1_000_000, description="Actions applied in one episode.")
    max_env_steps: int = Field(500, ge=1, le=10_000_000, description="Truncation limit (environment steps).")
    history_turns: int = Field(2, ge=0, le=64, description="Recent turns the producer keeps in context.")
    dt: float = Field(0.2, gt=0.0, le=1.0, description="Time per step (s); one RK4 step.")
    link_length_1: float = Field(1.0, gt=0.0, le=10.0, description="Length of the first link (m).")
    link_mass_1: float = Field(1.0, gt=0.0, le=100.0, description="Mass of the first link (kg).")
    link_mass_2: float = Field(1.0, gt=0.0, le=100.0, description="Mass of the second link (kg).")
    link_com_1: float = Field(0.5, gt=0.0, le=10.0, description="Centre of mass of link 1 from its joint (m).")
    link_com_2: float = Field(0.5, gt=0.0, le=10.0, description="Centre of mass of link 2 from its joint (m).")
    link_moi: float = Field(1.0, gt=0.0, le=100.0, description="Moment of inertia of each link.")
    gravity: float = Field(9.8, gt=0.0, le=100.0, description="Gravity (m/s^2).")
    max_vel_1: float = Field(4 * math.pi, gt=0.0, le=1_000.0, description="|dtheta1| is clipped to this (rad/s).")
    max_vel_2: float = Field(9 * math.pi, gt=0.0, le=1_000.0, description="|dtheta2| is clipped to this (rad/s).")
    init_range: float = Field(0.1, ge=0.0, le=1.0, description="Start state uniform in +/- this, per variable.")


AugmentedState = tuple[float, float, float, float, float]  # theta1, theta2, dtheta1, dtheta2, torque


def acrobot_derivatives(s: Sequence[float], params: AcrobotConfig) -> AugmentedState:
    """Time derivative of (theta1, theta2, dtheta1, dtheta2, torque), Sutton & Barto's ("book") form.

      d1 = m1 lc1^2 + m2 (l1^2 + lc2^2 + 2 l1 lc2 cos t2) + I1 + I2
      d2 = m2 (lc2^2 + l1 lc2 cos t2) + I2
      phi2 = m2 lc2 g cos(t1 + t2 - pi/2)
      phi1 = -m2 l1 lc2 dt2^2 sin t2 - 2 m2 l1 lc2 dt2 dt1 sin t2 + (m1 lc1 + m2 l1) g cos(t1 - pi/2) + phi2
      ddt2 = (a + d2/d1 phi1 - m2 l1 lc2 dt1^2 sin t2 - phi2) / (m2 lc2^2 + I2 - d2^2 / d1)
      ddt1 = -(d2 ddt2 + phi1) / d1
    The torque ``a`` is held constant over the step (its derivative is 0).
    """
    theta1, theta2, dtheta1, dtheta2, a = s
    m1, m2 = params.link_mass_1, params.link_mass_2
    l1, lc1, lc2 = params.link_length_1, params.link_com_1, params.link_com_2
    i1 = i2 = params.link_moi
    g = params.gravity
    d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * math.cos(theta2)) + i1 + i2
    d2 = m2 * (lc2**2 + l1 * lc2 * math.cos(theta2)) + i2
    phi2 = m2 * lc2 * g * math.cos(theta1 + theta2 - math.pi / 2.0)
    phi1 = (
        -m2 * l1 * lc2 * dtheta2**2 * math.sin(theta2)
        - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * math.sin(theta2)
        + (m1 * lc1 + m2 * l1) * g * math.cos(theta1 - math.pi / 2)
        + phi2
    )
    ddtheta2 = (a + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * math.sin(theta2) - phi2) / (
        m2 * lc2**2 + i2 - d2**2 / d1
    )
    ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
    return (dtheta1, dtheta2, ddtheta1, ddtheta2, 0.0)


def rk4_step(
    derivs: Callable[[Sequence[float]], Sequence[float]], y0: Sequence[float], dt: float
) -> tuple[float, ...]:
    """One classical Runge-Kutta step: y + dt/6 (k1 + 2 k2 + 2 k3 + k4)."""

    def shifted(k: Sequence[float], h: float) -> list[float]:
        return [y + h * dk for y, dk in zip(y0, k, strict=True)]

    k1 = derivs(y0)
    k2 = derivs(shifted(k1, dt / 2))
    k3 = derivs(shifted(k2, dt / 2))
    k4 = derivs(shifted(k3, dt))
    return tuple(y + dt / 6.0 * (a + 2 * b + 2 * c + d) for y, a, b, c, d in zip(y0, k1, k2, k3, k4, strict=True))


def wrap_angle(x: float, low: float = -math.pi, high: float = math.pi) -> float:
    """Wrap ``x`` into [low, high] by whole periods, as Gym's ``wrap`` does."""
    span = high - low
    while x > high:
        x -= span
    while x < low:
        x += span
    return x


def _clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def acrobot_step(state: Sequence[float], torque: float, params: AcrobotConfig) -> AcrobotState:
    """Advance (theta1, theta2, dtheta1, dtheta2) by ``dt`` under ``torque`` on the second joint."""
    augmented = (*state, float(torque))
    t1, t2, dt1, dt2, _ = rk4_step(lambda s: acrobot_derivatives(s, params), augmented, params.dt)
    return (
        wrap_angle(t1),
        wrap_angle(t2),
        _clip(dt1, -params.max_vel_1, params.max_vel_1),
        _clip(dt2, -params.max_vel_2, params.max_vel_2),
    )


def acrobot_tip_height(state: Sequence[float]) -> float:
    """Height of the tip above the pivot for unit links: -cos t1 - cos(t1 + t2)."""
    return -math.cos(state[0]) - math.cos(state[0] + state[1])


def acrobot_terminated(state: Sequence[float]) -> bool:
    """True once the tip is more than one link length above the pivot (Gym's goal line)."""
    return acrobot_tip_height(state) > 1.0


def acrobot_observation(state: Sequence[float]) -> list[float]:
    """Gym's observation: (cos t1, sin t1, cos t2, sin t2, dt1, dt2)."""
    t1, t2, dt1, dt2 = state
    return [math.cos(t1), math.sin(t1), math.cos(t2), math.sin(t2), dt1, dt2]


def acrobot_heuristic(state: Sequence[float]) -> int:
    """Energy pumping: drive the first link along the way it is already swinging.

    The torque acts on the middle joint, so the first link feels it with the
    opposite sign: torque = -sign(dtheta1) pushes link 1 along dtheta1 and adds
    energy every swing (0 when it is still).  With the opposite sign the
    acrobot never reaches the goal line in 500 steps.
    """
    dtheta1 = state[2]
    return -1 if dtheta1 > 0 else (1 if dtheta1 < 0 else 0)


class Acrobot(TextEnv[int]):
    """Swing a two-link pendulum's tip above the goal line with torque on the middle joint."""

    name: ClassVar[str] = "acrobot"
    long_horizon: ClassVar[bool] = True
    description: ClassVar[str] = (
        "Acrobot: two links hang from a pivot; apply torque -1, 0 or +1 to the joint between them to swing "
        "the tip above a line one link length over the pivot. -1 per step until it gets there (at most 500 steps)."
    )
    Config: ClassVar[type[EnvConfig]] = AcrobotConfig

    def _reset(self, seed: int) -> None:
        r = self.config.init_range
        self.state: AcrobotState = tuple(self.rng.uniform(-r, r) for _ in range(4))  # type: ignore[assignment]

    def _parse_action(self, text: str) -> int | None:
        return _ACROBOT_WORDS.get(text.strip().lower())

    def _idle_action(self) -> int:
        return 0  # no torque: the links swing on

    def _describe_idle(self, action: int) -> str:
        return "torque 0"

    def _apply_action(self, action: int) -> ActionOutcome:
        self.state = acrobot_step(self.state, float(action), self.config)
        terminated = acrobot_terminated(self.state)
        # Gym: -1 per step, 0 on the step that reaches the goal.
        return ActionOutcome(reward=0.0 if terminated else -1.0, terminated=terminated, success=terminated)

    def _render(self) -> str:
        c1, s1, c2, s2, dt1, dt2 = acrobot_observation(self.state)
        t1, t2 = self.state[0], self.state[1]
        return (
            f"Step {self.env_steps} of {self.config.max_env_steps}.\n"
            f"Joint 1: angle {t1:+.3f} rad (cos {c1:+.3f}, sin {s1:+.3f}), angular velocity {dt1:+.3f} rad/s\n"
            f"Joint 2: angle {t2:+.3f} rad (cos {c2:+.3f}, sin {s2:+.3f}), angular velocity {dt2:+.3f} rad/s\n"
            f"Tip height: {acrobot_tip_height(self.state):+.3f} (goal: above +1.000; range -2 to +2)\n"
            "Actions: -1 (negative torque), 0 (no torque), +1 (positive torque)."
        )

    def system_prompt(self) -> str:
        return (
            f"{self.description}\n"
            "Each turn you see both joint angles (0 = hanging straight down), their cosines and sines, and their "
            "angular velocities. Answer with one torque: -1, 0 or +1. The first link feels the torque with the "
            "opposite sign; timing the torque with its swing pumps energy into the system.\n"
            f"{ANSWER_FORMAT}"
        )

    def numeric_state(self) -> list[float]:
        return acrobot_observation(self.state)

    def action_vector(self, action: int) -> list[float]:
        return [float(action)]

    def features(self) -> dict[str, float]:
        return {"tip_height": acrobot_tip_height(self.state)}

    def heuristic_answer(self) -> str:
        return format_answer([_TORQUE_TEXT[acrobot_heuristic(self.state)]])

    def random_answer(self, rng: random.Random) -> str:
        return format_answer([rng.choice(["-1", "0", "+1"])])

    def answer_choices(self) -> list[str]:
        return [format_answer([torque]) for torque in ("-1", "0", "+1")]

    def action_help(self) -> str:
        return "answer a torque of -1, 0 or +1"
