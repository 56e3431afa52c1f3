"""The tuner core: pure search logic, no kopf, no kubernetes, no transport."""
