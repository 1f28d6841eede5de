"""The values of the English memory episodes (:mod:`.english`): names, cities, jobs and the rest.

Every pool has a ``"train"`` and a ``"heldout"`` part, disjoint; the numbers and dates are drawn
from ranges both splits share (:data:`NUMBER_RANGES`, :data:`MONTHS`). No value of one pool is a
value of another, and no word of a value is a word of the chatter (``tests/test_english_episodes.py``
checks both). All ASCII, so character tokenizers read them.
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    """A comma-separated list, one value per item (values may hold spaces)."""
    return [w.strip() for w in text.split(",") if w.strip()]


NAMES_TRAIN = _words(
    """Maria, Tom, Aisha, Daniel, Sofia, Lucas, Hannah, Omar, Elena, Jonas, Priya, Mateo, Chloe, Noah,
    Fatima, Ethan, Ingrid, Samuel, Leila, Oscar, Nadia, Felix, Clara, Hugo, Yuki, Adam, Zara, Leon, Mia,
    Ravi, Alice, Marco, Lena, Isaac, Amara, Theo, Nora, Diego, Emma, Karim, Julia, Ben, Sara, Tariq, Eva,
    Milo, Anya, Pablo, Greta, Kofi, Laura, Rafael, Ines, Victor, Maya, Joel, Alma, Simon, Lucia, Arjun,
    Freya, Caleb, Dina, Henrik, Rosa, Malik, Irene, Tobias, Helen, Yusuf, Carmen, Emil, Naomi, Hassan,
    Paula, Axel, Ada, Bruno, Celia, Dmitri, Erin, Farid, Gloria, Igor, Jana, Kai, Lara, Musa, Nina, Otto,
    Petra, Quentin, Rhea, Stefan, Tara, Umar, Vera, Walter, Xenia, Yara, Zoe, Anton, Bianca, Cyrus,
    Delia, Elias, Fiona, Gabriel, Hilda, Ivan, Kenji, Lotte, Magnus, Nell, Orla, Pedro, Ruth, Soren,
    Tessa, Ulla, Viktor, Wanda, Yvonne, Zeno, Aiden, Bea, Cormac, Dora, Edgar, Flora, Gideon, Heidi,
    Ibrahim, Josie, Kurt, Lydia, Moritz, Nico, Olga, Piet, Rania, Sven, Thea, Uri, Vivian, Wes, Xavier,
    Yasmin, Zeke, Abel, Brigitte, Cecil, Daria, Elif, Fabian, Gemma, Hamza, Ilse, Jude, Kira, Lorenzo,
    Marta, Nils, Odette, Pietro, Raquel, Sami, Tomas, Una, Vito, Wilma, Yann, Zelda, Alan, Berit, Colin,
    Dalia, Enzo, Frida, Goran, Hana, Ida, Jakob, Kamala, Luis, Mina, Nadine, Oren, Pia, Ronan, Selma"""
)
NAMES_HELDOUT = _words(
    """Agnes, Bastian, Cosima, Dorian, Esther, Florian, Gunnar, Hester, Imogen, Jarvis, Kasimir, Liesel,
    Matthias, Niamh, Ottilie, Percy, Quinn, Rosalind, Sigrid, Thaddeus, Ulrike, Valentin, Winifred,
    Yannick, Zuzana, Ambrose, Beatrix, Casimir, Dagny, Eamon, Fenna, Gustav, Hollis, Isolde, Jethro,
    Katya, Lucan, Marisol, Nestor, Ondine, Perpetua, Ragnar, Saoirse, Tiberius, Ursula, Vesna, Wolfram,
    Ximena, Yolanda, Zoltan, Alistair, Blanca, Cornelius, Desmond, Eulalia, Ferdinand, Gwendolyn,
    Horatio, Ilona, Jolene, Kasper, Leopold, Mirela, Nikolai, Octavia, Phineas, Radomir, Svetlana,
    Torvald, Unni, Vasco, Wilhelmina, Yevgeny, Zenobia, Anselm, Bronwen, Clement, Drusilla, Evander"""
)

CITIES_TRAIN = _words(
    """Lisbon, Oslo, Porto, Madrid, Berlin, Vienna, Prague, Dublin, Warsaw, Athens, Cairo, Nairobi, Lagos,
    Accra, Dakar, Tunis, Casablanca, Istanbul, Ankara, Tehran, Karachi, Mumbai, Delhi, Chennai, Dhaka,
    Kathmandu, Bangkok, Hanoi, Manila, Jakarta, Seoul, Osaka, Kyoto, Tokyo, Beijing, Shanghai, Taipei,
    Singapore, Perth, Melbourne, Auckland, Wellington, Toronto, Montreal, Vancouver, Chicago, Boston,
    Denver, Seattle, Portland, Phoenix, Atlanta, Houston, Dallas, Miami, Havana, Bogota, Quito, Lima,
    Montevideo, Caracas, Helsinki, Stockholm, Copenhagen, Bergen, Gothenburg, Hamburg, Munich, Cologne,
    Zurich, Geneva, Milan, Naples, Turin, Venice, Seville, Valencia, Bilbao, Marseille, Lyon, Bordeaux,
    Antwerp, Rotterdam, Utrecht, Edinburgh, Glasgow, Cardiff, Belfast, Leeds, Bristol, Krakow, Budapest,
    Bucharest, Belgrade, Zagreb, Riga, Tallinn, Vilnius, Kyiv, Tbilisi, Yerevan, Baku"""
)
CITIES_HELDOUT = _words(
    """Trondheim, Aarhus, Tampere, Uppsala, Leipzig, Dresden, Graz, Salzburg, Ljubljana, Sarajevo, Skopje,
    Tirana, Plovdiv, Gdansk, Poznan, Brno, Kosice, Debrecen, Thessaloniki, Izmir, Beirut, Amman, Muscat,
    Doha, Lahore, Pune, Kochi, Colombo, Chiang Mai, Da Nang, Cebu, Busan, Sapporo, Hobart, Dunedin,
    Halifax, Winnipeg, Calgary, Cusco, Medellin, Cordoba, Valparaiso"""
)

JOBS_TRAIN = _words(
    """nurse, teacher, plumber, architect, pilot, chef, dentist, lawyer, librarian, baker, electrician,
    engineer, pharmacist, journalist, firefighter, photographer, carpenter, accountant, translator,
    surgeon, veterinarian, gardener, mechanic, tailor, florist, physicist, geologist, paramedic,
    economist, designer, barista, butcher, locksmith, optician, midwife, sculptor, historian, programmer,
    biologist, zookeeper, waiter, potter, welder, judge"""
)
JOBS_HELDOUT = _words(
    """cartographer, glassblower, beekeeper, lamplighter, stonemason, bookbinder, perfumer,
    archivist, blacksmith, sommelier, taxidermist, puppeteer, watchmaker, upholsterer, meteorologist,
    actuary, cartoonist, ferry captain, lexicographer, chimney sweep"""
)

PETS_TRAIN = _words(
    """Biscuit, Mochi, Pickles, Noodle, Ziggy, Whiskers, Bandit, Buttons, Snowball, Rascal, Gizmo, Pixel,
    Rocket, Sprocket, Domino, Marble, Nugget, Scout, Shadow, Sparky, Tinker, Toffee, Wiggles, Zorro,
    Bubbles, Cricket, Fudge, Goose, Hopper, Jellybean, Lucky, Meatball, Peanut, Pebble, Radar, Skipper,
    Sprout, Tater, Tumble, Widget, Yoyo"""
)
PETS_HELDOUT = _words(
    """Bramble, Cobweb, Dandelion, Gumdrop, Hazelnut, Inkwell, Juniper, Moonbeam, Nimbus, Pistachio,
    Quibble, Rhubarb, Sherlock, Thimble, Velvet, Wobble, Zephyr, Fiddlesticks, Tamarind, Crumpet"""
)

FOODS_TRAIN = _words(
    """paella, sushi, lasagne, ramen, tacos, curry, pancakes, risotto, falafel, goulash, pierogi,
    dumplings, moussaka, burritos, pho, kimchi, hummus, couscous, gnocchi, ravioli, fish and chips,
    tiramisu, cheesecake, apple pie, chocolate cake, shakshuka, biryani, tagine, ceviche, empanadas,
    pad thai, jollof rice, bibimbap, pizza, spaghetti, croissants, baklava, churros, samosas, poutine,
    borscht"""
)
FOODS_HELDOUT = _words(
    """cassoulet, bouillabaisse, laksa, okonomiyaki, feijoada, khachapuri, bobotie, rendang, tamales,
    arancini, pavlova, dolma, kedgeree, mole, bigos, pastitsio"""
)

COLOURS_TRAIN = _words(
    "red, blue, green, yellow, orange, purple, pink, teal, navy, maroon, beige, turquoise, lilac, crimson, olive"
)
COLOURS_HELDOUT = _words("ochre, cerulean, magenta, chartreuse, vermilion, indigo, mauve, saffron")

VENUES_TRAIN = _words(
    """harbour cafe, central library, train station, botanical garden, bowling alley, fish market,
    ice rink, old cinema, science museum, tennis club, rooftop bar, bus depot, city zoo, art gallery,
    night market, food court, town square, boat house, yoga studio, record shop, climbing gym,
    chess club, flea market, sports hall, concert hall, skate park, book fair"""
)
VENUES_HELDOUT = _words(
    """observatory, lighthouse, tram depot, glasshouse, windmill, planetarium, ferry terminal,
    sculpture park, aquarium, velodrome, amphitheatre, greenhouse"""
)

PLACES_TRAIN = _words(
    """kitchen drawer, hall cupboard, garden shed, top shelf, glovebox, attic, cellar, bedside table,
    filing cabinet, desk drawer, coat pocket, shoebox, tool chest, laundry basket, safe, bookcase,
    wardrobe, sewing box, fruit bowl, letterbox, spare room, garage, sock drawer"""
)
PLACES_HELDOUT = _words(
    """umbrella stand, linen closet, tea caddy, pantry, boot rack, bread bin, dresser, toy chest,
    mantelpiece, potting shed"""
)

#: Only held-out episodes ask for an instrument (a relation training never sees).
INSTRUMENTS_HELDOUT = _words(
    "cello, violin, harp, trombone, oboe, clarinet, banjo, accordion, bassoon, ukulele, mandolin, tuba"
)

#: The words that make a question's key beside the person (shared by both splits: keys, not values).
ANIMALS = _words("dog, cat, parrot, rabbit, hamster, tortoise, goldfish, ferret, pony, lizard")
THINGS = _words(
    """passport, spare key, car key, birth certificate, diary, wedding ring, camera, torch, hairdryer,
    charger, stapler, notebook, tape measure, first aid kit"""
)
EVENTS = _words(
    """dentist appointment, job interview, flight, driving test, haircut, exam, eye test, concert,
    court hearing, vaccination"""
)
ITEMS = _words("bike, laptop, sofa, coat, phone, lamp, rug, desk, mattress, tent, scooter, watch, jacket")

MONTHS = _words(
    "January, February, March, April, May, June, July, August, September, October, November, December"
)
#: ``kind: (low, high)``, both included: the numbers both splits draw from.
NUMBER_RANGES = {"age": (18, 89), "room": (101, 999), "extension": (1000, 9999), "price": (30, 2000)}

#: ``kind: {"train": [...], "heldout": [...]}``, the word pools of :mod:`.english`'s relations.
POOLS = {
    "name": {"train": NAMES_TRAIN, "heldout": NAMES_HELDOUT},
    "city": {"train": CITIES_TRAIN, "heldout": CITIES_HELDOUT},
    "job": {"train": JOBS_TRAIN, "heldout": JOBS_HELDOUT},
    "pet": {"train": PETS_TRAIN, "heldout": PETS_HELDOUT},
    "food": {"train": FOODS_TRAIN, "heldout": FOODS_HELDOUT},
    "colour": {"train": COLOURS_TRAIN, "heldout": COLOURS_HELDOUT},
    "venue": {"train": VENUES_TRAIN, "heldout": VENUES_HELDOUT},
    "place": {"train": PLACES_TRAIN, "heldout": PLACES_HELDOUT},
    "instrument": {"train": [], "heldout": INSTRUMENTS_HELDOUT},
}
