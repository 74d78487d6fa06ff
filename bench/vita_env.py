"""VitaBench's domain tools, re-implemented: the deterministic environment bench/vita.py runs its tasks on.

A port of the public VitaBench delivery and in-store tools (search stores/products, store/product info,
create/pay/cancel/modify orders, book/reserve, time/location/weather/holiday queries) over a task's own
database; bench/vita.py's docstring lists where it differs from upstream on purpose and why. `VitaEnv` is the
environment, `tool_schemas(domain)` its tool list, `final_items()` the state the scorer compares.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
from datetime import datetime, timedelta

from bench import Task

DOMAINS = ("delivery", "instore")            # the domains this port implements
STOP = "###STOP###"
TIME_FMT = "%Y-%m-%d %H:%M:%S"

# ------------------------------------------------------------------------------------------- schemas
# (name, description, [(arg, type, description, required)]); types: string, integer, number, boolean,
# string[], integer[].

GENERIC_TOOLS = [
    ("longitude_latitude_to_distance", "Distance in meters between two points given by longitude and latitude.",
     [("longitude1", "number", "Longitude of the first point", True), ("latitude1", "number", "Latitude of the first point", True),
      ("longitude2", "number", "Longitude of the second point", True), ("latitude2", "number", "Latitude of the second point", True)]),
    ("weather", "Weather for an address (city) between date_start and date_end.",
     [("address", "string", "Address or city to query", True), ("date_start", "string", "Start date, yyyy-mm-dd", True),
      ("date_end", "string", "End date, yyyy-mm-dd", True)]),
    ("address_to_longitude_latitude", "Longitude and latitude of an address.",
     [("address", "string", "Address to look up", True)]),
    ("get_date_holiday_info", "Whether a date is a Chinese public holiday, and which.",
     [("date", "string", "Date, yyyy-mm-dd", True)]),
    ("get_holiday_date", "The date of a named holiday or festival in a given year.",
     [("year", "string", "Year, e.g. 2025", True), ("holiday_name", "string", "Holiday name", True)]),
    ("get_user_historical_behaviors", "The user's basic information (user id, home and work address) and historical "
     "preferences per scenario (categories, price range, ratings, times, recent orders, searches).", []),
    ("get_user_all_orders", "All of the user's orders.", []),
    ("get_nearby", "All stores/shops within a range (meters) of a point.",
     [("longitude", "number", "Longitude", True), ("latitude", "number", "Latitude", True),
      ("range", "number", "Range in meters", True)]),
]
DELIVERY_TOOLS = [
    ("delivery_distance_to_time", "Delivery time (minutes) for a distance (meters).",
     [("distance", "number", "Distance in meters", True)]),
    ("get_delivery_store_info", "Store details: id, rating, address, coordinates, tags and product list.",
     [("store_id", "string", "Store id", True)]),
    ("get_delivery_product_info", "Food details: name, id, store name and id, price, tags.",
     [("product_id", "string", "Food (product) id", True)]),
    ("delivery_store_search_recommand", "Search/recommend delivery stores from keywords describing them.",
     [("keywords", "string[]", "Keywords describing the store", True)]),
    ("delivery_product_search_recommand", "Search/recommend food items from keywords describing them.",
     [("keywords", "string[]", "Keywords describing the food", True)]),
    ("create_delivery_order", "Create a delivery order from ONE store (several foods allowed). Returns the order "
     "(unpaid); ask the user to confirm payment.",
     [("user_id", "string", "User id", True), ("store_id", "string", "Store id", True),
      ("product_ids", "string[]", "Food ids", True), ("product_cnts", "integer[]", "Quantity of each food id", True),
      ("address", "string", "Delivery address", True),
      ("dispatch_time", "string", "When the rider picks the food up at the store, yyyy-mm-dd HH:MM:SS, not in the past", True),
      ("attributes", "string[]", "Specification/attributes of each food id", False),
      ("note", "string", "Order note, e.g. dietary restrictions (not time requirements)", False)]),
    ("pay_delivery_order", "Pay an unpaid delivery order after the user confirms.",
     [("order_id", "string", "Order id", True)]),
    ("get_delivery_order_status", "Status of a delivery order.", [("order_id", "string", "Order id", True)]),
    ("cancel_delivery_order", "Cancel a delivery order (or its payment); not one already cancelled.",
     [("order_id", "string", "Order id", True)]),
    ("modify_delivery_order", "Change the note of a delivery order.",
     [("order_id", "string", "Order id", True), ("note", "string", "New note", True)]),
    ("search_delivery_orders", "The user's delivery orders with a given status.",
     [("user_id", "string", "User id", True), ("status", "string", "Order status, default unpaid", False)]),
    ("get_delivery_order_detail", "Full details of a delivery order.", [("order_id", "string", "Order id", True)]),
]
INSTORE_TOOLS = [
    ("instore_shop_search_recommend", "Search/recommend in-store merchants from keywords (tags, names).",
     [("keywords", "string[]", "Keywords describing the merchant", True)]),
    ("instore_product_search_recommend", "Search/recommend in-store packages/products from keywords.",
     [("keywords", "string[]", "Keywords describing the package", True)]),
    ("create_instore_product_order", "Submit an in-store order for one package of a shop (unpaid).",
     [("user_id", "string", "User id", True), ("shop_id", "string", "Merchant id", True),
      ("product_id", "string", "Package id", True), ("quantity", "integer", "Quantity, default 1", False)]),
    ("pay_instore_order", "Pay an unpaid in-store order.", [("order_id", "string", "Order id", True)]),
    ("instore_cancel_order", "Cancel an in-store order (not one already cancelled).",
     [("order_id", "string", "Order id", True)]),
    ("instore_book", "Book a seat/table at a shop that supports booking (unpaid if the shop charges for it).",
     [("user_id", "string", "User id", True), ("shop_id", "string", "Merchant id", True),
      ("time", "string", "Booking time, yyyy-mm-dd HH:MM:SS", True), ("customer_count", "integer", "Party size, default 1", False)]),
    ("pay_instore_book", "Pay a seat booking.", [("book_id", "string", "Booking id", True)]),
    ("instore_cancel_book", "Cancel a seat booking.", [("book_id", "string", "Booking id", True)]),
    ("instore_reservation", "Reserve a service time at a shop.",
     [("user_id", "string", "User id", True), ("shop_id", "string", "Merchant id", True),
      ("time", "string", "Reservation time, yyyy-mm-dd HH:MM:SS", True), ("customer_count", "integer", "Party size, default 1", False)]),
    ("instore_modify_reservation", "Change the time (and party size) of a reservation.",
     [("reservation_id", "string", "Reservation id", True), ("time", "string", "New time, yyyy-mm-dd HH:MM:SS", True),
      ("customer_count", "integer", "New party size (0 keeps it)", False)]),
    ("instore_cancel_reservation", "Cancel a reservation.", [("reservation_id", "string", "Reservation id", True)]),
    ("get_instore_orders", "All in-store orders of a user.", [("user_id", "string", "User id", True)]),
    ("get_instore_reservations", "All reservations of a user.", [("user_id", "string", "User id", True)]),
    ("get_instore_books", "All seat bookings of a user.", [("user_id", "string", "User id", True)]),
    ("search_instore_book", "A user's seat bookings, or one by id.",
     [("user_id", "string", "User id", True), ("book_id", "string", "Booking id (optional)", False)]),
    ("search_instore_reservation", "A user's reservations, or one by id.",
     [("user_id", "string", "User id", True), ("reservation_id", "string", "Reservation id (optional)", False)]),
]
_TOOL_SPECS = {"delivery": GENERIC_TOOLS + DELIVERY_TOOLS, "instore": GENERIC_TOOLS + INSTORE_TOOLS}


def _json_type(t: str) -> dict:
    return {"type": "array", "items": {"type": t[:-2]}} if t.endswith("[]") else {"type": t}


def tool_schemas(domain: str) -> list[dict]:
    """The JSON tool schemas of a VitaBench domain (delivery or instore); ValueError for another one."""
    if domain not in _TOOL_SPECS:
        raise ValueError(f"unknown VitaBench domain {domain!r}; choose one of: {', '.join(DOMAINS)}")
    return [{"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object",
                       "properties": {a: {**_json_type(t), "description": d} for a, t, d, _ in args},
                       "required": [a for a, _, _, req in args if req]}}}
        for name, desc, args in _TOOL_SPECS[domain]]


# -------------------------------------------------------------------------------------- fuzzy helpers

def _ratio(a: str, b: str) -> float:
    return 100.0 * difflib.SequenceMatcher(None, a, b).ratio() if (a or b) else 0.0


def _partial_ratio(a: str, b: str) -> float:
    """Best ratio of the shorter string against equally long windows of the longer (case-insensitive)."""
    a, b = a.lower(), b.lower()
    short, long_ = (a, b) if len(a) <= len(b) else (b, a)
    if not short:
        return 0.0
    best = 0.0
    for i, j, _ in difflib.SequenceMatcher(None, short, long_).get_matching_blocks():
        start = max(0, j - i)
        best = max(best, _ratio(short, long_[start:start + len(short)]))
        if best == 100.0:
            break
    return best


def _distance(lon1, lat1, lon2, lat2) -> float:
    if lon1 == lon2 and lat1 == lat2:
        return 0.0
    lon1, lat1, lon2, lat2 = map(math.radians, (lon1, lat1, lon2, lat2))
    a = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return float(round(6371000 * 2 * math.asin(math.sqrt(a))))


# Festival dates (get_holiday_date) and statutory days off (get_date_holiday_info), 2023-2026.
FESTIVALS = {
    "2023": {"New Year's Day": "01-01", "Spring Festival": "01-22", "Lantern Festival": "02-05", "Valentine's Day": "02-14",
             "Qingming Festival": "04-05", "Labor Day": "05-01", "Mother's Day": "05-14", "Father's Day": "06-18",
             "Dragon Boat Festival": "06-22", "Qixi Festival": "08-22", "Mid-Autumn Festival": "09-29",
             "National Day": "10-01", "Double Ninth Festival": "10-23", "Winter Solstice": "12-22", "Christmas Day": "12-25"},
    "2024": {"New Year's Day": "01-01", "Spring Festival": "02-10", "Valentine's Day": "02-14", "Lantern Festival": "02-24",
             "Qingming Festival": "04-04", "Labor Day": "05-01", "Mother's Day": "05-12", "Dragon Boat Festival": "06-10",
             "Father's Day": "06-16", "Qixi Festival": "08-10", "Mid-Autumn Festival": "09-17", "National Day": "10-01",
             "Double Ninth Festival": "10-11", "Winter Solstice": "12-21", "Christmas Day": "12-25"},
    "2025": {"New Year's Day": "01-01", "Laba Festival": "01-07", "Spring Festival": "01-29", "Lantern Festival": "02-12",
             "Valentine's Day": "02-14", "Dragon Head Festival": "03-01", "Women's Day": "03-08",
             "Qingming Festival": "04-04", "Labor Day": "05-01", "Mother's Day": "05-11", "Dragon Boat Festival": "05-31",
             "Father's Day": "06-15", "Party Founding Day": "07-01", "Start of Autumn": "08-07", "Qixi Festival": "08-29",
             "National Day": "10-01", "Mid-Autumn Festival": "10-06", "Double Ninth Festival": "10-29",
             "Winter Solstice": "12-21", "Christmas Day": "12-25"},
    "2026": {"New Year's Day": "01-01", "Valentine's Day": "02-14", "Spring Festival": "02-17", "Lantern Festival": "03-03",
             "Qingming Festival": "04-05", "Labor Day": "05-01", "Mother's Day": "05-10", "Dragon Boat Festival": "06-19",
             "Father's Day": "06-21", "Qixi Festival": "08-19", "Mid-Autumn Festival": "09-25", "National Day": "10-01",
             "Double Ninth Festival": "10-18", "Winter Solstice": "12-22", "Christmas Day": "12-25"},
}
ZH_NAMES = {"New Year's Day": "元旦", "Spring Festival": "春节", "Lantern Festival": "元宵节", "Valentine's Day": "情人节",
            "Qingming Festival": "清明节", "Labor Day": "劳动节", "Mother's Day": "母亲节", "Father's Day": "父亲节",
            "Dragon Boat Festival": "端午节", "Qixi Festival": "七夕节", "Mid-Autumn Festival": "中秋节",
            "National Day": "国庆节", "Double Ninth Festival": "重阳节", "Winter Solstice": "冬至", "Christmas Day": "圣诞节",
            "Laba Festival": "腊八节", "Dragon Head Festival": "龙抬头", "Women's Day": "妇女节",
            "Party Founding Day": "建党节", "Start of Autumn": "立秋"}
DAYS_OFF = {  # (first, last, name) per year
    "2023": [("01-01", "01-02", "New Year's Day"), ("01-21", "01-27", "Spring Festival"), ("04-05", "04-05", "Qingming Festival"),
             ("04-29", "05-03", "Labor Day"), ("06-22", "06-24", "Dragon Boat Festival"),
             ("09-29", "09-29", "Mid-Autumn Festival"), ("09-30", "10-06", "National Day")],
    "2024": [("01-01", "01-01", "New Year's Day"), ("02-10", "02-17", "Spring Festival"), ("04-04", "04-06", "Qingming Festival"),
             ("05-01", "05-05", "Labor Day"), ("06-10", "06-10", "Dragon Boat Festival"),
             ("09-15", "09-17", "Mid-Autumn Festival"), ("10-01", "10-07", "National Day")],
    "2025": [("01-01", "01-01", "New Year's Day"), ("01-28", "02-04", "Spring Festival"), ("04-04", "04-06", "Qingming Festival"),
             ("05-01", "05-05", "Labor Day"), ("05-31", "06-02", "Dragon Boat Festival"),
             ("10-06", "10-06", "Mid-Autumn Festival"), ("10-01", "10-08", "National Day")],
    "2026": [("01-01", "01-03", "New Year's Day"), ("02-15", "02-23", "Spring Festival"), ("04-04", "04-06", "Qingming Festival"),
             ("05-01", "05-05", "Labor Day"), ("06-19", "06-21", "Dragon Boat Festival"),
             ("09-25", "09-27", "Mid-Autumn Festival"), ("10-01", "10-07", "National Day")],
}


# ------------------------------------------------------------------------------------------ environment

class ToolError(Exception):
    """A tool's refusal; VitaEnv.step returns it as an 'Error: ...' response."""
    pass


def _need(cond, msg):
    if not cond:
        raise ToolError(msg)


def _check_time(value: str, fmt: str = TIME_FMT) -> bool:
    """Upstream's check_time_format (vita/utils/utils.py): only a ValueError means "wrong format"; a value that
    is not a string raises strptime's TypeError ("strptime() argument 1 must be str, not int"), which upstream's
    environment turns into an "Error: ..." observation."""
    try:
        datetime.strptime(value, fmt)
        return True
    except ValueError:
        return False


def _fuzzy_query(value):
    """Upstream ranks with thefuzz, whose processor refuses a query that is not a string: TypeError
    "sentence must be a String" (address, weather city, holiday name)."""
    if not isinstance(value, str):
        raise TypeError("sentence must be a String")
    return value


def _keywords(keywords) -> list[str]:
    """Upstream's search tools rank on "".join(keywords): a list of strings or a string (joined, it is itself)
    works; a number or a list holding a non-string raises join's TypeError ("can only join an iterable",
    "sequence item 0: expected str instance, int found")."""
    joined = "".join(keywords)
    return keywords if isinstance(keywords, list) else [joined]


def _pydantic_error(model: str, errors: list[tuple[str, str, str, object]]) -> TypeError:
    """The text of the pydantic ValidationError upstream's data models raise on a wrongly typed field, as
    upstream's environment shows it ("Error: " + str(error)), less pydantic's version-specific help-link lines.
    errors: (field location, message, error type, input value)."""
    n = len(errors)
    lines = [f"{n} validation error{'s' if n > 1 else ''} for {model}"]
    for loc, msg, kind, value in errors:
        lines += [loc, f"  {msg} [type={kind}, input_value={value!r}, input_type={type(value).__name__}]"]
    return TypeError("\n".join(lines))


def _int_field(loc: str, value):
    """(coerced value, error or None) as pydantic's lax `int` field: bool and integral float become int."""
    if isinstance(value, bool):
        return int(value), None
    if isinstance(value, float):
        if value.is_integer():
            return int(value), None
        return value, (loc, "Input should be a valid integer, got a number with a fractional part", "int_from_float", value)
    if isinstance(value, int):
        return value, None
    return value, (loc, "Input should be a valid integer", "int_type", value)


def _validate(model: str, *checks):
    errors = [e for e in checks if e is not None]
    if errors:
        raise _pydantic_error(model, errors)


def _dump(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


ID_KEYS = ("order_id", "book_id", "reservation_id")


class VitaEnv:
    """One task's database plus the domain tools. step() never raises."""

    def __init__(self, task: Task, user_fn=None):
        self.task = task
        self.domain = task.metadata["domain"]
        self.lang = task.metadata.get("lang", "en")
        self.user_fn = user_fn
        self.db = copy.deepcopy(task.metadata["environment"])
        for key in ("orders", "books", "reservations"):
            self.db[key] = dict(self.db.get(key) or {})
        self.initial = copy.deepcopy({k: self.db[k] for k in ("orders", "books", "reservations")})
        self.counter = 0
        self.aliases: dict[str, str] = {}      # ids invented in rehearsal -> ids really created
        self.last_created: str | None = None
        self.specs = {name: args for name, _, args in _TOOL_SPECS[self.domain]}
        self.stores = (self.db.get("stores") if self.domain == "delivery" else self.db.get("shops")) or {}

    # -- protocol
    def step(self, name: str, arguments: dict) -> str:
        """Check the tool name and arguments, run the tool and return its response; every failure becomes an
        'Error: ...' text, as upstream answers it."""
        self.last_created = None
        if name not in self.specs:
            return f"Error: unknown tool {name!r}; available tools: {', '.join(self.specs)}"
        if not isinstance(arguments, dict):
            return f"Error: arguments for {name} must be a JSON object, got {type(arguments).__name__}"
        spec = self.specs[name]
        allowed = {a for a, *_ in spec}
        extra = [k for k in arguments if k not in allowed]
        if extra:
            return f"Error: {name} got unexpected argument(s) {extra}; expected {sorted(allowed)}"
        for arg, t, _, required in spec:
            if required and (arg not in arguments or arguments[arg] is None):
                return f"Error: {name} is missing required argument {arg!r}"
        # No JSON-type check: upstream's tools receive the raw JSON values, so each tool below treats a wrongly
        # typed value as upstream's does (coerces, accepts, refuses or raises at the same point).
        args = {k: v for k, v in arguments.items() if v is not None}
        try:
            return getattr(self, "_t_" + name)(**args)
        except ToolError as e:
            return f"Error: {e}"
        except Exception as e:   # what upstream's Environment.get_response answers for a tool that raises
            return f"Error: {e}"

    def user_turn(self, assistant_text: str) -> str | None:
        """The simulated user's reply, or None (the end) without a simulator or once the assistant wrote STOP."""
        if self.user_fn is None or STOP in (assistant_text or ""):
            return None
        return self.user_fn(assistant_text, self.task)

    # -- helpers
    @property
    def now(self) -> str:
        """The task's current time (the database's), else the wall clock's, in TIME_FMT."""
        return self.db.get("time") or datetime.now().strftime(TIME_FMT)

    def _user_ok(self, user_id: str):
        _need(user_id, "User ID cannot be empty")
        _need(user_id == self.db.get("user_id"), "User ID does not match")

    def _new_id(self, prefix: str, scenario: str) -> str:
        self.counter += 1
        oid = prefix + hashlib.md5(f"{scenario}|{self.db.get('user_id')}|{self.counter}".encode()).hexdigest()[:10]
        self.last_created = oid
        return oid

    def _resolve(self, table: str, item_id: str) -> dict:
        item_id = self.aliases.get(item_id, item_id)
        if item_id in self.db[table]:
            return self.db[table][item_id]
        for x in self.db[table].values():        # a few initial rows are stored under a key != their id
            if item_id in (x.get(k) for k in ID_KEYS):
                return x
        raise ToolError(f"{ {'orders': 'Order', 'books': 'BookInfo', 'reservations': 'ReservationInfo'}[table]} "
                        f"{item_id} not found")

    def _products(self) -> dict[str, dict]:
        """product_id -> product (with its store id/name); first store wins for duplicate ids."""
        out = {}
        for sid, s in self.stores.items():
            for p in s.get("products") or []:
                if p.get("product_id") and p["product_id"] not in out:
                    out[p["product_id"]] = {**p, "store_id": p.get("store_id") or p.get("shop_id") or sid,
                                            "store_name": p.get("store_name") or s.get("name") or s.get("shop_name")}
        return out

    def _store_brief(self, s: dict) -> dict:
        return {k: v for k, v in s.items() if k != "products"}

    def _known_locations(self) -> dict[str, tuple[float, float]]:
        locs = {}
        for loc in self.db.get("location") or []:
            locs[loc["address"]] = (loc["longitude"], loc["latitude"])
        for s in self.stores.values():
            if s.get("location"):
                locs.setdefault(s["location"]["address"], (s["location"]["longitude"], s["location"]["latitude"]))
        for o in self.db["orders"].values():
            if o.get("location"):
                locs.setdefault(o["location"]["address"], (o["location"]["longitude"], o["location"]["latitude"]))
        return locs

    def _locate(self, address: str) -> tuple[float, float]:
        _fuzzy_query(address)
        locs = self._known_locations()
        if address in locs:
            return locs[address]
        scored = sorted(((_partial_ratio(address, a), a) for a in locs), key=lambda x: -x[0])
        if scored and scored[0][0] >= 30 and _ratio(address.lower(), scored[0][1].lower()) >= 20:
            return locs[scored[0][1]]
        raise ToolError(f"Longitude and latitude not found for address {address}")

    def _search(self, keywords: list[str], docs: dict[str, str], top_k: int) -> list[str]:
        kws = [k for k in _keywords(keywords) if k.strip()] or [""]
        scored = [(sum(_partial_ratio(k, doc) for k in kws) / len(kws), i, key) for i, (key, doc) in enumerate(docs.items())]
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [key for _, _, key in scored[:top_k]]

    # -- generic tools
    def _t_longitude_latitude_to_distance(self, longitude1, latitude1, longitude2, latitude2):
        return _dump(_distance(longitude1, latitude1, longitude2, latitude2))

    def _t_weather(self, address, date_start, date_end):
        _need(_check_time(date_start, "%Y-%m-%d"), f"Invalid date_start format. Expected yyyy-mm-dd, got: {date_start}")
        _need(_check_time(date_end, "%Y-%m-%d"), f"Invalid date_end format. Expected yyyy-mm-dd, got: {date_end}")
        _fuzzy_query(address)
        cities = list(dict.fromkeys(w["city"] for w in self.db.get("weather") or []))
        best = max(cities, key=lambda c: _partial_ratio(address, c), default=None)
        _need(best is not None and _partial_ratio(address, best) >= 50, f"Weather information not found for {address}")
        rows = sorted((w for w in self.db["weather"] if w["city"] == best and date_start <= w["datetime"] <= date_end),
                      key=lambda w: w["datetime"])
        return "\n".join(_dump(w) for w in rows) if rows else \
            f"No weather information found for {best} between {date_start} and {date_end}"

    def _t_address_to_longitude_latitude(self, address):
        return _dump(list(self._locate(address)))

    def _t_get_date_holiday_info(self, date):
        _need(_check_time(date, "%Y-%m-%d"), f"Date format error, should be yyyy-mm-dd, actual: {date}")
        for first, last, name in DAYS_OFF.get(date[:4], []):
            if date[:4] + "-" + first <= date <= date[:4] + "-" + last:
                return ZH_NAMES[name] if self.lang == "zh" else name
        return f"Date {date} is not a holiday"

    def _t_get_holiday_date(self, year, holiday_name):
        table = FESTIVALS.get(year)      # upstream: `if year not in holiday_data` (str keys; 2025 is not found)
        if table is None:
            return f"Holiday data for year {year} not found"
        _fuzzy_query(holiday_name)
        names = {(ZH_NAMES[n] if self.lang == "zh" else n): d for n, d in table.items()}
        best = max(names, key=lambda n: _partial_ratio(holiday_name, n))
        if _partial_ratio(holiday_name, best) >= 80:
            return f"{year}-{names[best]}"
        return f"Holiday named '{holiday_name}' not found in year {year}"

    def _t_get_user_historical_behaviors(self):
        return _dump(self.db.get("user_historical_behaviors") or {})

    def _t_get_user_all_orders(self):
        orders = list(self.db["orders"].values())
        return "\n".join(_dump(o) for o in orders) if orders else "User currently has no order information"

    def _t_get_nearby(self, longitude, latitude, range):
        near = [self._store_brief(s) for s in self.stores.values() if s.get("location") and
                _distance(longitude, latitude, s["location"]["longitude"], s["location"]["latitude"]) <= range]
        return "\n".join(_dump(s) for s in near) if near else "No search results found"

    # -- delivery tools
    def _t_delivery_distance_to_time(self, distance):
        _need(isinstance(distance, (float, int)), f"distance value type should be float or int, but get {type(distance)}")
        return _dump(float(round(25.0 + int(distance) * 0.006510)))

    def _t_get_delivery_store_info(self, store_id):
        _need(store_id in self.stores, f"Store {store_id} not found")
        return _dump(self.stores[store_id])

    def _t_get_delivery_product_info(self, product_id):
        products = self._products()
        _need(product_id in products, f"{product_id} not found")
        return _dump(products[product_id])

    def _t_delivery_store_search_recommand(self, keywords):
        docs = {sid: f"{s.get('name', '')} {' '.join(s.get('tags') or [])}" for sid, s in self.stores.items()}
        return "\n".join(_dump(self._store_brief(self.stores[sid])) for sid in self._search(keywords, docs, 100))

    def _t_delivery_product_search_recommand(self, keywords):
        products = self._products()
        docs = {pid: f"{p.get('store_name', '')} {p.get('name', '')} {' '.join(p.get('tags') or [])}" for pid, p in products.items()}
        return "\n".join(_dump(products[pid]) for pid in self._search(keywords, docs, 100))

    def _t_create_delivery_order(self, user_id, store_id, product_ids, product_cnts, address, dispatch_time,
                                 attributes=None, note=""):
        # The checks run in upstream's order, on the raw values (vita/domains/delivery/tools.py).
        self._user_ok(user_id)
        _need(store_id in self.stores, f"Store {store_id} not found")
        products = self._products()
        for pid in product_ids:                   # upstream's _get_store_product raises "<id> not found"
            if pid not in products:
                raise ToolError(f"{pid} not found")
        _need(len(product_ids) > 0, f"products {product_ids} not found")   # ours: no empty order
        _need(address != "", f"Location {address} is empty")
        _need(len(product_ids) == len(product_cnts) and all([c > 0 for c in product_cnts]),
              f"product_cnts {product_cnts} list is invalid")
        _need(dispatch_time and _check_time(dispatch_time),
              f"dispatch_time {dispatch_time} time format is invalid, yyyy-mm-dd HH:MM:SS required")
        _need(dispatch_time >= self.now, f"dispatch_time {dispatch_time} must be in the future")
        lon, lat = self._locate(address)
        store = self.stores[store_id]
        dist = _distance(lon, lat, store["location"]["longitude"], store["location"]["latitude"])
        shipping = float(round(25.0 + int(dist) * 0.006510))
        delivery_time = (datetime.strptime(dispatch_time, TIME_FMT) + timedelta(minutes=shipping)).strftime(TIME_FMT)
        total = sum(products[pid].get("price", 0) * c for pid, c in zip(product_ids, product_cnts))
        attrs = [""] * len(product_ids)
        for i, a in enumerate((attributes if attributes is not None else [])[:len(product_ids)]):
            if a:
                attrs[i] = a
        lines = []
        for pid, c, a in zip(product_ids, product_cnts, attrs):      # upstream's StoreProduct(...) validation
            qty, bad_qty = _int_field("quantity", c)
            bad_attr = None
            if isinstance(a, list):
                a = ", ".join(a)                  # its attributes validator
            elif not isinstance(a, str):
                bad_attr = [("attributes.str", "Input should be a valid string", "string_type", a),
                            ("attributes.list[any]", "Input should be a valid list", "list_type", a)]
            _validate("StoreProduct", bad_qty, *(bad_attr or []))
            lines.append({"product_id": pid, "name": products[pid].get("name"), "store_id": products[pid]["store_id"],
                          "price": products[pid].get("price", 0), "quantity": qty, "attributes": a})
        _validate("Order", None if isinstance(note, str) else ("note", "Input should be a valid string", "string_type", note))
        order = {"order_id": self._new_id("OT", "delivery"), "order_type": "delivery", "user_id": user_id,
                 "store_id": store_id, "note": note,
                 "location": {"address": address, "longitude": lon, "latitude": lat},
                 "dispatch_time": dispatch_time, "shipping_time": shipping, "delivery_time": delivery_time,
                 "total_price": round(total, 2),
                 "create_time": self.now, "update_time": self.now, "status": "unpaid", "products": lines}
        self.db["orders"][order["order_id"]] = order
        return _dump(order)

    def _delivery_order(self, order_id):
        o = self._resolve("orders", order_id)
        _need(o.get("order_type") == "delivery", f"Order {order_id} is not a delivery order")
        return o

    def _t_pay_delivery_order(self, order_id):
        o = self._delivery_order(order_id)
        if o["status"] != "unpaid":
            return "Order is not in `unpaid` status."
        o["status"], o["update_time"] = "paid", self.now
        return "Payment successful"

    def _t_get_delivery_order_status(self, order_id):
        return self._delivery_order(order_id)["status"]

    def _t_cancel_delivery_order(self, order_id):
        o = self._delivery_order(order_id)
        _need(o["status"] != "cancelled", f"Order {o['order_id']} is already cancelled")
        o["status"], o["update_time"] = "cancelled", self.now
        return f"Order {o['order_id']} has been cancelled."

    def _t_modify_delivery_order(self, order_id, note):
        o = self._delivery_order(order_id)
        o["note"], o["update_time"] = note, self.now
        return f"Order {o['order_id']} has been modified."

    def _t_search_delivery_orders(self, user_id, status="unpaid"):
        self._user_ok(user_id)
        rows = [o for o in self.db["orders"].values()
                if o.get("order_type") == "delivery" and o.get("status") == status and o.get("user_id") == user_id]
        return "\n".join(_dump(o) for o in rows) if rows else "No delivery orders available"

    def _t_get_delivery_order_detail(self, order_id):
        _need(order_id, "Order ID cannot be empty")
        return _dump(self._delivery_order(order_id))

    # -- in-store tools
    def _t_instore_shop_search_recommend(self, keywords):
        docs = {sid: f"{s.get('shop_name', '')},{','.join(s.get('tags') or [])}" for sid, s in self.stores.items()}
        return "\n".join(_dump(self._store_brief(self.stores[sid])) for sid in self._search(keywords, docs, 1000))

    def _t_instore_product_search_recommend(self, keywords):
        products = self._products()
        docs = {pid: f"{p.get('name', '')},{','.join(p.get('tags') or [])}" for pid, p in products.items()}
        return "\n".join(_dump(products[pid]) for pid in self._search(keywords, docs, 1000))

    def _t_create_instore_product_order(self, user_id, shop_id, product_id, quantity=1):
        self._user_ok(user_id)
        _need(shop_id in self.stores, "Shop does not exist")
        prods = self.stores[shop_id].get("products") or []
        _need(product_id in [p.get("product_id") for p in prods], "Product does not exist")   # a list: no error
        _need(quantity > 0, "Quantity must be greater than 0")
        p = next(p for p in prods if p.get("product_id") == product_id)
        # upstream assigns quantity to the product unvalidated: 1.5, True, 2.0 are stored and priced as given
        order = {"order_id": self._new_id("OI", "instore"), "order_type": "instore", "user_id": user_id,
                 "store_id": shop_id, "note": "", "location": None, "total_price": round(quantity * p.get("price", 0), 2),
                 "create_time": self.now, "update_time": self.now, "status": "unpaid",
                 "products": [{"product_id": product_id, "name": p.get("name"), "shop_id": shop_id,
                               "price": p.get("price", 0), "quantity": quantity, "tags": p.get("tags", [])}]}
        self.db["orders"][order["order_id"]] = order
        return _dump(order)

    def _instore_order(self, order_id):
        o = self._resolve("orders", order_id)
        _need(o.get("order_type") == "instore", f"Order {order_id} is not an instore order")
        return o

    def _t_pay_instore_order(self, order_id):
        _need(order_id, "Order ID cannot be empty")
        o = self._instore_order(order_id)
        if o["status"] != "unpaid":
            return f"Order {o['order_id']} is not in `unpaid` status."
        o["status"], o["update_time"] = "paid", self.now
        return "Payment successful"

    def _t_instore_cancel_order(self, order_id):
        _need(order_id, "Order ID cannot be empty")
        o = self._instore_order(order_id)
        if o["status"] == "cancelled":
            return f"Order {o['order_id']} is already cancelled."
        o["status"], o["update_time"] = "cancelled", self.now
        return f"Order {o['order_id']} is cancelled."

    def _t_instore_book(self, user_id, shop_id, time, customer_count=1):
        self._user_ok(user_id)
        _need(shop_id in self.stores, "Shop does not exist")
        _need(customer_count > 0, "Number of customers for table booking must be greater than 0")
        _need(time, "Table booking time cannot be empty")
        _need(_check_time(time), "Table booking time format is incorrect, correct format is %Y-%m-%d %H:%M:%S")
        shop = self.stores[shop_id]
        _need(shop.get("enable_book"), "Shop does not support table booking")
        price = shop.get("book_price", 0) or 0
        customer_count, bad = _int_field("customer_count", customer_count)     # upstream's BookInfo(...)
        _validate("BookInfo", bad)
        book = {"book_id": self._new_id("OI", "instore_book"), "shop_id": shop_id, "book_time": time,
                "customer_id": user_id, "customer_count": customer_count, "book_price": price,
                "status": "unpaid" if price > 0 else "paid", "update_time": self.now}
        self.db["books"][book["book_id"]] = book
        return _dump(book)

    def _t_pay_instore_book(self, book_id):
        _need(book_id, "Booking ID cannot be empty")
        b = self._resolve("books", book_id)
        if b["status"] != "unpaid":
            return f"BookInfo {b['book_id']} is not in `unpaid` status."
        b["status"], b["update_time"] = "paid", self.now
        return "Payment successful"

    def _t_instore_cancel_book(self, book_id):
        _need(book_id, "Booking ID cannot be empty")
        b = self._resolve("books", book_id)
        if b["status"] == "cancelled":
            return f"BookInfo {b['book_id']} is already cancelled."
        b["status"], b["update_time"] = "cancelled", self.now
        return f"BookInfo {b['book_id']} is cancelled."

    def _t_instore_reservation(self, user_id, shop_id, time, customer_count=1):
        self._user_ok(user_id)
        _need(shop_id in self.stores, "Shop does not exist")
        _need(_check_time(time), "Reservation time format is incorrect, correct format is %Y-%m-%d %H:%M:%S")
        _need(customer_count > 0, "Number of customers for reservation must be greater than 0")
        customer_count, bad = _int_field("customer_count", customer_count)     # upstream's ReservationInfo(...)
        _validate("ReservationInfo", bad)
        r = {"reservation_id": self._new_id("OI", "instore_reservation"), "shop_id": shop_id, "reservation_time": time,
             "customer_id": user_id, "customer_count": customer_count, "status": "unconsumed", "update_time": self.now}
        self.db["reservations"][r["reservation_id"]] = r
        return _dump(r)

    def _t_instore_modify_reservation(self, reservation_id, time, customer_count=0):
        _need(reservation_id, "Reservation ID cannot be empty")
        r = self._resolve("reservations", reservation_id)
        if r["status"] in ("consumed", "cancelled"):
            return f"ReservationInfo {r['reservation_id']} is already {r['status']}."
        _need(customer_count >= 0, "Number of customers for reservation must be greater than or equal to 0")
        _need(time, "Reservation time cannot be empty")
        _need(_check_time(time), "Reservation time format is incorrect, correct format is %Y-%m-%d %H:%M:%S")
        r["reservation_time"], r["update_time"] = time, self.now
        if customer_count > 0:                    # upstream assigns it unvalidated: 1.5 or True is stored as given
            r["customer_count"] = customer_count
        return _dump(r)

    def _t_instore_cancel_reservation(self, reservation_id):
        _need(reservation_id, "Reservation ID cannot be empty")
        r = self._resolve("reservations", reservation_id)
        if r["status"] == "cancelled":
            return f"ReservationInfo {r['reservation_id']} is already cancelled."
        r["status"], r["update_time"] = "cancelled", self.now
        return f"ReservationInfo {r['reservation_id']} is cancelled."

    def _t_get_instore_orders(self, user_id):
        self._user_ok(user_id)
        rows = [o for o in self.db["orders"].values() if o.get("order_type") == "instore" and o.get("user_id") == user_id]
        return "\n".join(_dump(o) for o in rows) if rows else f"User {user_id} has no order information."

    def _user_rows(self, table, user_id, what):
        self._user_ok(user_id)
        rows = [x for x in self.db[table].values() if x.get("customer_id") == user_id]
        return "\n".join(_dump(x) for x in rows) if rows else f"User {user_id} has no {what} information."

    def _t_get_instore_reservations(self, user_id):
        return self._user_rows("reservations", user_id, "reservation")

    def _t_get_instore_books(self, user_id):
        return self._user_rows("books", user_id, "book")

    def _t_search_instore_book(self, user_id, book_id=None):
        if book_id is None:
            return self._user_rows("books", user_id, "book")
        self._user_ok(user_id)
        b = self._resolve("books", book_id)
        return _dump(b) if b.get("customer_id") == user_id else f"BookInfo {book_id} is not belong to user {user_id}."

    def _t_search_instore_reservation(self, user_id, reservation_id=None):
        if reservation_id is None:
            return self._user_rows("reservations", user_id, "reservation")
        self._user_ok(user_id)
        r = self._resolve("reservations", reservation_id)
        return _dump(r) if r.get("customer_id") == user_id else \
            f"ReservationInfo {reservation_id} is not belong to user {user_id}."

    # -- state for scoring
    def final_items(self) -> list[dict]:
        """Every order, booking and reservation now in the database, normalised for scoring (and whether it was
        there initially and changed status)."""
        return [_item(x, key in self.initial[table], self.initial[table].get(key))
                for table in ("orders", "books", "reservations") for key, x in self.db[table].items()]


# -------------------------------------------------------------------------------------------- scoring

def _kind(x: dict) -> str:
    return "order" if "order_id" in x else "book" if "book_id" in x else "reservation" if "reservation_id" in x else "?"


def _status_class(kind: str, status: str) -> str:
    if status == "cancelled":
        return "cancelled"
    if kind == "reservation":
        return "active"
    return "unpaid" if status == "unpaid" else "paid"


def _norm_time(t):
    return t + ":00" if isinstance(t, str) and len(t) == 16 else t   # "2024-10-26 16:00" in a few tasks


def _item(x: dict, initial=False, initial_row=None) -> dict:
    kind = _kind(x)
    it = {"kind": kind, "id": x.get("order_id") or x.get("book_id") or x.get("reservation_id"),
          "status": _status_class(kind, x.get("status", "")), "initial": initial,
          "changed": initial_row is not None and initial_row.get("status") != x.get("status")}
    if kind == "order":
        qty = {}
        for p in x.get("products") or []:
            if isinstance(p, dict) and p.get("product_id"):
                qty[p["product_id"]] = qty.get(p["product_id"], 0) + int(p.get("quantity") or 0)
        it.update(store=x.get("store_id"), products=qty)
    else:
        it.update(store=x.get("shop_id"), time=_norm_time(x.get("reservation_time") or x.get("book_time")),
                  count=x.get("customer_count"))
    return it
