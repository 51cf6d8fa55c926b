"""How a run is shown in the cell."""
