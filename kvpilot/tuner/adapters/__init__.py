"""Adapters: where a trial is applied and where its signals come from."""
