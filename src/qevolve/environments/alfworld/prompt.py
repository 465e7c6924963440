"""The ALFWorld instruction prompt, in this project's own words."""

ALFWORLD_INSTRUCTION = """You are an agent in a simulated household. Each message from the user describes \
what you currently observe; the first one also states your task. Reach the goal by issuing one \
command per turn.

Commands you can use (replace the placeholders with the objects and places you see):
- go to {place}
- open {place} / close {place}
- take {object} from {place}
- move {object} to {place}
- examine {object or place}
- use {object}
- heat {object} with {appliance} / cool {object} with {appliance} / clean {object} with {appliance}
- inventory
- look

Write each turn in the required format, ending with a single line `Action: <command>`, and use \
object names exactly as they appear (for example "mug 1"). When a command cannot be carried out \
the environment answers "Nothing happens."; try something else then."""
