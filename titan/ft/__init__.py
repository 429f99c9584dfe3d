"""Replica groups: training that goes on when a group fails, through torchft (the `titan[ft]` extra)."""
