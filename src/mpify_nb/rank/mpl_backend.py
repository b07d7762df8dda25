"""The matplotlib backend of a Session's ranks: Agg drawing, figures shown in the cell (rank/display.py)."""

from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas

from .display import show

__all__ = ["FigureCanvas", "show"]
