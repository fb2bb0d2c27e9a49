"""The fleet inside `maced`: `admin` (publish, roll back, list the fleet adapter) and `rounds`
(train a round on the local pairs of consenting users, evaluate a candidate on held-out pairs).
"""
