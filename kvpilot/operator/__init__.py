"""The kvpilot operator: kopf handlers (thin) over pure builders (spec in, manifests out)."""
