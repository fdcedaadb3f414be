"""``rlpipe sweep``: a grid of experiments run in parallel against one server, and their leaderboard.

``plan`` (the grid, the experiments, the sweep's folder), ``runner`` (the
experiments' processes) and ``leaderboard`` (the ranking, its table and plot).
"""
