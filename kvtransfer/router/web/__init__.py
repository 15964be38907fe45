"""The router's HTTP surface, the top of the router: the aiohttp app and its OpenAI endpoints
(`app`, request life cycle docstring), admission in front of the flows (`admission`), the
answers written on the daemons' flow (`answers`), error answers in OpenAI's shape
(`http_errors`), the fleet and flow opened on the app's loop (`backend`), and the admin API
(`admin_api`). Pages about the fleet (a ``/dashboard``) belong here too: a module of their own
that reads the fleet through `app.RouterHandlers.fleet` and adds its routes in `app.make_app`,
as `admin_api` does."""
