"""The pictures of the image demo dialog, drawn with Pillow (nothing downloaded or shipped):
a sunset over the sea (landscape) and a sailing boat (portrait), so their tile grids differ."""

from PIL import Image, ImageDraw


def sunset(width: int = 320, height: int = 200) -> Image.Image:
    img = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(img)
    horizon = height * 3 // 5
    for y in range(horizon):  # sky: deep blue to orange towards the horizon
        t = y / horizon
        draw.line([(0, y), (width, y)], fill=(int(40 + 215 * t), int(40 + 110 * t), int(120 - 60 * t)))
    r = height // 6
    draw.ellipse([width // 2 - r, horizon - r, width // 2 + r, horizon + r], fill=(255, 200, 60))
    for y in range(horizon, height):  # sea, with the sun's reflection
        t = (y - horizon) / (height - horizon)
        draw.line([(0, y), (width, y)], fill=(int(30 + 20 * t), int(60 + 30 * t), int(110 + 40 * t)))
        if y % 6 < 2:
            half = int(r * (1 - t))
            draw.line([(width // 2 - half, y), (width // 2 + half, y)], fill=(250, 170, 70))
    return img


def boat(width: int = 180, height: int = 260) -> Image.Image:
    img = Image.new("RGB", (width, height), (150, 200, 240))
    draw = ImageDraw.Draw(img)
    sea = height * 2 // 3
    draw.rectangle([0, sea, width, height], fill=(20, 80, 150))
    mast = width // 2
    draw.line([(mast, sea - 150), (mast, sea - 10)], fill=(90, 60, 30), width=4)
    draw.polygon([(mast + 4, sea - 145), (mast + 4, sea - 25), (mast + 70, sea - 25)], fill=(250, 250, 245))
    draw.polygon([(mast - 4, sea - 120), (mast - 4, sea - 25), (mast - 50, sea - 25)], fill=(230, 80, 60))
    draw.polygon([(mast - 70, sea - 15), (mast + 80, sea - 15), (mast + 55, sea + 12), (mast - 50, sea + 12)],
                 fill=(120, 50, 30))
    draw.ellipse([width - 60, 20, width - 20, 60], fill=(255, 240, 150))
    return img


def demo_images() -> list[Image.Image]:
    return [sunset(), boat()]
