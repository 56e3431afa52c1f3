"""The fleet: how many replicas an InferenceService needs for its load, at the engine config in force.

`planner` is the pure core (demand, capacity and burn rates in; a replica count and its reason out).
"""
