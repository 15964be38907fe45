"""The router's HTTP surface, the top of the router: the aiohttp app and its OpenAI endpoints
(`app`, request life cycle docstring), admission in front of the flows (`admission`), the
answers written on the daemons' flow (`answers`), error answers in OpenAI's shape
(`http_errors`), the fleet and flow opened on the app's loop (`backend`), the admin API
(`admin_api`), and the fleet page (``/dashboard``, `fleet_page`): the JSON it draws
(`fleet_state`) and the last requests it lists (`recent`). The page's HTML, script and style
are files in ``static/``, served as they are."""
