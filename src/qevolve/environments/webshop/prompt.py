"""The WebShop instruction prompt, in this project's own words."""

WEBSHOP_INSTRUCTION = """You are shopping in an online store on behalf of a customer. The first message \
gives the customer's request; every message shows the current web page as text, its parts \
separated by [SEP]. Find the product that best fits the request, choose the options it asks for \
(size, colour, flavour, ...) and buy it, within the price limit if one is given.

Two kinds of action exist:
- search[keywords]: search the store for the keywords you write (for example search[blue cotton \
t-shirt for men]).
- click[button]: click something shown on the page: a product code from the results (for \
example click[B07XJ8C8F5]), an option value, Next > or < Prev to move between pages, \
Description, Features or Reviews for more detail, Back to Search, or Buy Now.

Write each turn in the required format, ending with a single line `Action: <action>`. Only text \
shown on the current page can be clicked; anything else does nothing. Buy Now ends the task, and \
the purchase is scored on how well the product, its options and its price fit the request."""
