"""Drive an engine by hand in a notebook: an ipywidgets explorer (needs a live kernel).

Works with ipywidgets 7.7 (Colab) and 8.x: it uses only widgets, traits and
calls that both have. Where no kernel runs (the built book, a notebook opened
without running it) a widget is an empty box, so the explorer's output also
carries a still picture (``image/png``) of the step its slider shows; front
ends with a widget manager show the live widget instead, and the book's
``_config.yml`` tells myst-nb to prefer the picture.
"""
from __future__ import annotations

import base64
import io

import matplotlib.pyplot as plt

from enginelib.core.engine import Engine
from enginelib.model.sampling import SamplingParams
from enginelib.viz.figures import busiest_frame, plot_engine_step

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class EngineExplorer:
    """Step, play, add a request, abort one: the block map and the timeline follow.

    The slider walks through recorded steps (it starts at the busiest one);
    "run one step" runs the engine and shows the new step.
    """

    def __init__(self, engine: Engine, params: SamplingParams | None = None) -> None:
        import ipywidgets as w

        if not engine.config.record:
            raise ValueError("the explorer needs an engine created with EngineConfig(record=True)")
        self.engine, self.params = engine, params
        top = max(0, len(engine.history) - 1)
        start = busiest_frame(engine.history) if engine.history else 0
        self.slider = w.IntSlider(value=start, min=0, max=top, description="step")
        self.play = w.Play(value=start, min=0, max=top, interval=600)
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.step_button = w.Button(description="run one step")
        self.prompt = w.Text(value="", placeholder="a new prompt", layout=w.Layout(width="320px"))
        self.add_button = w.Button(description="add request")
        self.victim = w.Dropdown(options=[], description="abort")
        self.abort_button = w.Button(description="abort it")
        self.out = w.Output()
        self.message = w.HTML(value="")
        self.step_button.on_click(lambda _: self.run_step())
        self.add_button.on_click(lambda _: self.add(self.prompt.value))
        self.abort_button.on_click(lambda _: self.abort(self.victim.value))
        self.slider.observe(lambda change: self.draw(change["new"]), names="value")
        self.widget = w.VBox([w.HBox([self.play, self.slider, self.step_button]),
                              w.HBox([self.prompt, self.add_button, self.victim, self.abort_button]),
                              self.message, self.out])
        self._refresh()

    def run_step(self) -> None:
        self.engine.step()
        self._refresh(last=True)

    def add(self, prompt: str) -> None:
        try:
            rid = self.engine.add_request(prompt, self.params)
            self.message.value = f"added request {rid}"
        except ValueError as err:
            self.message.value = f"<b>refused:</b> {err}"
        self._refresh()

    def abort(self, request_id: str | None) -> None:
        if request_id:
            self.engine.abort(request_id)
            self.message.value = f"aborted request {request_id}"
        self._refresh()

    def draw(self, index: int) -> None:
        from IPython.display import display

        with self.out:
            self.out.clear_output(wait=True)
            if not self.engine.history:
                print("no steps yet: press 'run one step'")
                return
            fig = plot_engine_step(self.engine.history, index)
            display(fig)
            plt.close(fig)

    def still_png(self) -> bytes | None:
        """The picture of the step the slider shows (None before the first step)."""
        if not self.engine.history:
            return None
        fig = plot_engine_step(self.engine.history, self.slider.value)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        return buffer.getvalue()

    def _refresh(self, last: bool = False) -> None:
        live = [r.request_id for r in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)]
        self.victim.options = live
        top = max(0, len(self.engine.history) - 1)
        self.slider.max = self.play.max = top
        if last or self.slider.value > top:
            self.slider.value = top
        self.draw(self.slider.value)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """The live widget for front ends with a widget manager, plus a still for those without."""
        steps = len(self.engine.history)
        bundle = {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id},
                  "text/plain": f"EngineExplorer at step {self.slider.value} of {steps} recorded "
                                f"(run the notebook to drive it)"}
        png = self.still_png()
        if png is not None:
            bundle["image/png"] = base64.b64encode(png).decode("ascii")
        return bundle


__all__ = ["EngineExplorer"]
